"""Per-layer device time of one prefill step and one decode step, eager (no CUDA graphs), for models whose
kernels are still to come (DeepSeek-V4): the starting point the kernels are measured against.

    python -m loadgen.layer_times --model-path deepseek-v4-flash \
        --hf-overrides '{"num_hidden_layers": 8, "num_nextn_predict_layers": 0}' \
        --prefill-context 32768 --prefill-tokens 4096 --decode-batch 64 --decode-context 1024

Prefill: one request whose first `--prefill-context` tokens are prefilled in chunks of
`--prefill-tokens`, then one more chunk of `--prefill-tokens` new tokens: that step is timed. Decode:
`--decode-batch` requests with `--decode-context` tokens each, then decode steps; the last is timed,
for V4 once per `--decode-path` (request by request, then batched, by default).
CUDA events around every decoder layer (forward pre/post hooks) give each layer's time; the rest of the
step (embedding, head, sampling, host work) is reported as one line. Weights are random (dummy)."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4.attention import TorchV4Backend
from runtime.gpu.testing import PagedPlanBuilder, seq_start


class LayerClock:
    """Records a CUDA event before and after each decoder layer; read after the step synchronises. On the
    CPU (tests) the hooks read the host clock instead."""

    def __init__(self, layers: torch.nn.ModuleList, cuda: bool) -> None:
        self.events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self.on, self.cuda = False, cuda
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._start(i))
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._stop(i))
        self._open: dict[int, torch.cuda.Event] = {}

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, i: int) -> None:
        if self.on:
            self._open[i] = self._mark()

    def _stop(self, i: int) -> None:
        if self.on and i in self._open:
            self.events.append((i, self._open.pop(i), self._mark()))

    def per_layer_ms(self) -> dict[int, float]:
        _sync(self.cuda)
        out: dict[int, float] = defaultdict(float)
        for i, start, end in self.events:
            out[i] += start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        self.events.clear()
        return dict(out)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _kinds(config) -> list[str]:
    attn = getattr(config, "layer_types", None) or ["attention"] * config.num_hidden_layers
    mlp = getattr(config, "mlp_layer_types", None) or [""] * config.num_hidden_layers
    short = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
             "heavily_compressed_attention": "HCA"}  # fmt: skip
    return [f"{short.get(a, a)} + {m}".rstrip(" +") for a, m in zip(attn, mlp, strict=False)]


def _timed(runner: ModelRunner, clock: LayerClock, plan) -> tuple[float, dict[int, float]]:
    _sync(clock.cuda)
    clock.on = True
    t = time.perf_counter()
    runner.execute(plan)
    _sync(clock.cuda)
    wall = (time.perf_counter() - t) * 1e3
    clock.on = False
    return wall, clock.per_layer_ms()


def _report(title: str, wall: float, layers: dict[int, float], kinds: list[str]) -> None:
    print(f"{title}: step {wall:.1f} ms (wall, synchronised)")
    for i in sorted(layers):
        print(f"  layer {i:>2} {kinds[i] if i < len(kinds) else 'mtp':<22} {layers[i]:9.2f} ms")
    print(f"  {'rest of the step':<31} {wall - sum(layers.values()):9.2f} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", "--model", required=True, help="model directory or dummy preset name")
    p.add_argument("--hf-overrides", type=json.loads, default=None, help="JSON merged into config.json")
    p.add_argument("--prefill-context", type=int, default=32768)
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode-path", choices=("batched", "per-row", "both"), default="both",
                   help="DeepSeek-V4 decode attention: every row at once (attention_decode.py), request "
                   "by request (attention.py), or each in turn on consecutive steps")  # fmt: skip
    args = p.parse_args(argv)

    prefill_total = args.prefill_context + args.prefill_tokens
    decode_total = args.decode_context + args.decode_steps * (2 if args.decode_path == "both" else 1)
    # Whole pages per request of up to MAX_PAGE tokens (V4 pages hold whole 128-token windows).
    max_page = 128
    pages = 2 + (-(-prefill_total // max_page)) + args.decode_batch * (-(-decode_total // max_page))
    cfg = RunnerConfig(args.model_path, device=args.device, load_format="dummy", hf_overrides=args.hf_overrides,
                       num_kv_slots=pages * max_page, max_reqs=args.decode_batch + 1,
                       max_model_len=max(prefill_total, decode_total) + 1, cuda_graph=False,
                       page_size=max_page)  # fmt: skip
    runner = ModelRunner(cfg)
    page = runner.kv_pool.page_multiple
    assert max_page % page == 0, f"page size {page} does not divide {max_page}"
    layers = runner.model.model.layers
    clock, kinds = LayerClock(layers, runner.device.type == "cuda"), _kinds(runner.config)
    gen = torch.Generator().manual_seed(0)
    vocab = min(runner.vocab_size, 32000)
    pb = PagedPlanBuilder(page, num_slots=cfg.num_kv_slots)

    # prefill: chunks up to the context, then the timed chunk
    prompt = torch.randint(3, vocab, (prefill_total,), generator=gen).tolist()
    chunk, pos = args.prefill_tokens, 0
    while pos < prefill_total:
        n = min(chunk, prefill_total - pos)
        plan = pb.plan([1], [pos], [n], prompt[pos : pos + n], sample=[pos + n == prefill_total],
                       added=[seq_start(1, prompt)] if pos == 0 else ())  # fmt: skip
        if pos + n == prefill_total:
            wall, per = _timed(runner, clock, plan)
            _report(f"prefill {n} new tokens on a {pos}-token context", wall, per, kinds)
        else:
            runner.execute(plan)
        pos += n
    # decode: release the prefill row, fill `decode_batch` rows, then time decode steps
    rows = list(range(2, args.decode_batch + 2))
    prompts = {r: torch.randint(3, vocab, (args.decode_context,), generator=gen).tolist() for r in rows}
    per_step = max(1, args.prefill_tokens // args.decode_context)
    released = [1]
    for i in range(0, len(rows), per_step):
        group = rows[i : i + per_step]
        plan = pb.plan(group, [0] * len(group), [args.decode_context] * len(group),
                       [t for r in group for t in prompts[r]], added=[seq_start(r, prompts[r]) for r in group],
                       released=released)  # fmt: skip
        released = []
        runner.execute(plan)
    ctx, backend = args.decode_context, runner.attn
    paths = {"batched": [True], "per-row": [False], "both": [False, True]}[args.decode_path]
    if not isinstance(backend, TorchV4Backend):  # models without the two V4 paths: one report
        paths = [None]
    for batched in paths:
        if batched is not None:
            backend.batched_decode = batched
        for step in range(args.decode_steps):
            plan = pb.plan(rows, [ctx] * len(rows), [1] * len(rows), [], use_last=[True] * len(rows))
            if step == args.decode_steps - 1:
                wall, per = _timed(runner, clock, plan)
                how = {None: "", True: ", batched", False: ", request by request"}[batched]
                _report(f"decode batch {len(rows)} at context {ctx}{how}", wall, per, kinds)
            else:
                runner.execute(plan)
            ctx += 1


if __name__ == "__main__":
    main()
