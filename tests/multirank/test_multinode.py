"""Two "machines" on the loopback: `conduit serve --nnodes 2 --node-rank 0|1 --dist-init-addr` with one
TP rank each. Node 0 serves HTTP and its rank; node 1 runs only its rank, whose messages cross TCP. The
greedy text equals transformers' generate, and Ctrl-C on node 0 stops node 1's rank and agent too."""

from __future__ import annotations

import signal
import subprocess
import sys

import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loadgen.launch import free_port
from runtime.gpu.testing import greedy_chat_texts

PROMPT = "What is the capital of France?"
MAX_TOKENS = 12
SMALL = ("--cpu-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8")


def test_two_nodes_serve_greedy_text_and_stop_together(launch_server, smollm2_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    (expected,) = greedy_chat_texts(model, tok, [PROMPT], MAX_TOKENS)
    dist = f"127.0.0.1:{free_port()}"
    world = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", dist, *SMALL)
    log1 = open(tmp_path / "node1.log", "wb")  # noqa: SIM115 (closed below)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "serve", *world, "--node-rank", "1"],
        stdout=log1,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with launch_server(*world, "--node-rank", "0") as node0:
            client = openai.OpenAI(base_url=node0.base_url, api_key="unused", max_retries=0, timeout=120)
            r = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                temperature=0,
                max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": PROMPT}],
            )
            assert r.choices[0].message.content == expected
            node0.proc.send_signal(signal.SIGINT)
            node0.proc.wait(timeout=30)
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        assert "node_stopped" in (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
        log1.close()
