"""The `conduit` command line: the one place a ServerConfig is built from flags."""

from __future__ import annotations

import argparse
import json
import sys

from runtime.config import ServerConfig
from runtime.disaggregation.config import add_disaggregation_flags
from runtime.parsers.tool_calls import PARSERS as TOOL_CALL_PARSERS


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        "--model-path",
        default=None,
        help="Hugging Face model directory (config.json + safetensors), or with --load-format dummy "
        "a preset name (llama-3.1-8b, llama-3.2-1b, deepseek-v4-flash). Default: the embedded "
        "SmolLM2-135M-Instruct, converted from its GGUF file on first use",
    )
    g.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: directory name)"
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=d.load_format,
        help="`dummy`: random weights of the model's config, for performance work",
    )
    g.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N")
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: float32 on cpu, bfloat16 on cuda",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8_e4m3"],
        default=d.kv_cache_dtype,
        help="`auto`: the model's dtype; `fp8_e4m3`: half the KV bytes (scale 1.0, as SGLang/vLLM "
        "without calibrated scales), Llama-family and DeepSeek-V2/V3 models",
    )
    g.add_argument(
        "--quantization",
        choices=["auto", "none", "fp8"],
        default=d.quantization,
        help="weights of DeepSeek-V2/V3/V4 (as vLLM/SGLang's --quantization fp8): `fp8` keeps FP8 128x128 "
        "block-scaled weights and runs FP8 GEMMs (and V4's routed experts packed FP4 when the config says "
        "expert_dtype fp4), quantizing a bf16 checkpoint or dummy weights at load; "
        "`none` dequantizes an FP8 checkpoint; `auto`: fp8 for an FP8 checkpoint on cuda, else none",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed for random weights and unseeded sampling")
    g.add_argument(
        "--hf-overrides",
        "--json-model-override-args",
        dest="hf_overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="JSON object merged into the model's config.json, as vLLM's --hf-overrides / SGLang's "
        "--json-model-override-args; e.g. '{\"num_hidden_layers\": 8}' keeps the first 8 layers",
    )
    g = p.add_argument_group("limits")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (prompt + output); default: the model's, capped at 8192",
    )
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="requests decoded together at most (default: 256 on GPUs of 60 GB and more, else 128)",
    )
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens: on cuda a cap on what --mem-fraction-static leaves for it (default: "
        "no cap), on cpu the size (default 32768)",
    )
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="cuda: the share of GPU memory for the weights and the KV pool, the rest left for activations "
        "and CUDA graphs (default by GPU memory: 0.9 from 120 GB, 0.88 from 60 GB, 0.85 from 35 GB, else 0.8)",
    )
    g.add_argument(
        "--page-size",
        type=int,
        default=d.page_size,
        help="tokens per KV page (the prefix cache matches whole pages). 64 lets Hopper kernels copy whole "
        "pages by TMA: DeepSeek MLA decode, and Llama decode over an fp8 KV cache (docs/PERF.md)",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="token budget of one step (prefill chunks + decodes); default by device: 2048 on cpu, on cuda "
        "2048 / 8192 / 16384 under 35 GB / under 160 GB (H100, H200) / above, as SGLang",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="waiting requests beyond which new ones get 429",
    )
    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--schedule-policy",
        choices=["fcfs", "lpm"],
        default=d.schedule_policy,
        help="admission order: first come first served, or longest cached prefix first",
    )
    g.add_argument(
        "--schedule-conservativeness",
        type=_positive_float,
        default=d.schedule_conservativeness,
        help="how much of each running request's remaining max_tokens admission keeps free (1.0: 70%% "
        "at first, decaying while nothing is retracted); lower admits more requests and retracts more",
    )
    g.add_argument(
        "--disable-overlap", action="store_true", help="plan each step only after the last one ended"
    )
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix caching across requests")
    g.add_argument(
        "--engram-placement",
        choices=("host", "device", "split"),
        default=d.engram_placement,
        help="Engram tables (models with an `engram` config block): host (EngramShardActor processes, "
        "host memory), device (whole table on the GPU), split (rows sharded over engram ranks)",
    )
    g.add_argument(
        "--engram-shards", type=int, default=d.engram_shards, help="host: shard processes; split: ranks"
    )
    g.add_argument(
        "--disable-engram-prefetch",
        action="store_true",
        help="fetch Engram rows only when the first Engram layer needs them (benchmarks)",
    )
    g.add_argument(
        "--engram-lookup-delay-ms",
        type=float,
        default=0.0,
        help="injected latency per Engram lookup (benchmarks of the prefetch)",
    )
    g.add_argument(
        "--swa-replay-tokens",
        type=int,
        default=None,
        help="DeepSeek-V4 prefix hits: tokens before the hit recomputed to rebuild the sliding-window "
        "and compressor state (SWA bounded replay; default: the model's sliding window)",
    )
    g.add_argument(
        "--swa-replay-exact",
        action="store_true",
        help="DeepSeek-V4 prefix hits: replay from position 0, so a hit equals a cold run (slow; for "
        "checking the bounded replay)",
    )
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        choices=["ngram", "draft-model", "mtp", "dspark"],
        default=None,
        help="draft tokens with this drafter and verify them together (lossless: the output follows the "
        "model's own distribution); ngram: the continuation of the latest earlier occurrence of the last "
        "tokens (prompt lookup); draft-model: a smaller model of the same tokenizer (--speculative-draft-model-path); "
        "mtp: the checkpoint's multi-token-prediction (nextn) layer, chained (DeepSeek-V3 and V4); dspark: DSpark's "
        "block drafter on the target's layer features (the checkpoint's mtp.* weights, random without them)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="draft-model: a Hugging Face directory (or preset) sharing the target's tokenizer",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=d.speculative_num_draft_tokens,
        help="most draft tokens a request verifies per step (each request adapts below it to its "
        "acceptance and the batch's load, unless --speculative-draft-policy fixed)",
    )
    g.add_argument(
        "--speculative-draft-policy",
        choices=["adaptive", "fixed"],
        default=d.speculative_draft_policy,
        help="adaptive: each request verifies the drafts its acceptance so far and the batch's load make "
        "worth it, and stops speculating for a while where they do not pay; fixed: every draft the "
        "drafter proposes, up to --speculative-num-draft-tokens",
    )
    g.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=d.speculative_ngram_min_match_window_size,
        help="ngram: the shortest tail of the sequence looked up",
    )
    g.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=d.speculative_ngram_max_match_window_size,
        help="ngram: the longest tail looked up (longer matches are tried first)",
    )
    g = p.add_argument_group("fast path")
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (for comparison)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch captured as a CUDA graph (default: --max-running-requests)",
    )
    g.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default=None,
        help="default: triton on cuda, torch (the reference) on cpu",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads of a CPU engine (default: one per core). On a small machine shared with other "
        "work, 1 keeps step times steady: with one thread per core, every op waits for the busiest core",
    )
    g = p.add_argument_group("placement")
    g.add_argument(
        "--placement",
        choices=["multiprocess", "single"],
        default=d.placement,
        help="actors in a frontend + an engine process, or all in this one",
    )
    g = p.add_argument_group("parallelism (docs/parallelism.md)")
    g.add_argument(
        "--tp-size",
        "--tp",
        type=int,
        default=d.tp_size,
        help="engine ranks (one process and GPU each); dense layers split over them (tensor parallelism)",
    )
    g.add_argument(
        "--dp-size",
        "--dp",
        type=int,
        default=d.dp_size,
        help="with --enable-dp-attention: data-parallel attention groups, each with its own scheduler and KV",
    )
    g.add_argument(
        "--enable-dp-attention", action="store_true", help="attention data-parallel over --dp-size groups"
    )
    g.add_argument(
        "--ep-size", "--ep", type=int, default=d.ep_size, help="MoE experts split over this many ranks"
    )
    g.add_argument(
        "--ep-num-redundant-experts",
        type=int,
        default=d.ep_num_redundant_experts,
        help="extra expert slots holding copies of experts (placed by EPLB from an even load)",
    )
    g.add_argument(
        "--expert-placement",
        default=None,
        metavar="JSON",
        help="file of an expert placement (which rank holds which expert), e.g. from "
        "`runtime.gpu.layers.expert_parallel.rebalance` on measured load",
    )
    g.add_argument(
        "--moe-a2a-backend",
        choices=["auto", "all_to_all"],
        default=d.moe_a2a_backend,
        help="`auto`: MoE tokens travel by all_to_all_single when experts split over ranks; `all_to_all`: "
        "the exchange even on one rank (measures the EP path against the plain fused MoE)",
    )
    g.add_argument(
        "--expert-load-out",
        default=None,
        metavar="DIR",
        help="at shutdown each rank writes the tokens its MoE exchanges routed to each expert there; "
        "`python -m runtime.gpu.layers.expert_parallel DIR --ep-size N --slots M` turns them into a "
        "--expert-placement file (EPLB)",
    )
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the ranks span")
    g.add_argument("--node-rank", type=int, default=d.node_rank, help="this machine's index (0: HTTP)")
    g.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="where rank 0 gathers the ranks (default: a free loopback port; needed with --nnodes > 1)",
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=d.max_engine_restarts,
        help="an engine process that dies is restarted (its requests fail, /health is 503 meanwhile) "
        "up to this many times in 10 minutes",
    )


def add_http_flags(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("http")
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request body (and WebSocket message) limit; default: 64 bytes per token of context, "
        "at least 1 MiB",
    )
    g.add_argument(
        "--max-requests-per-websocket",
        type=int,
        default=d.max_requests_per_websocket,
        help="live request ids on one WebSocket",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="on SIGTERM/SIGINT: seconds requests in flight get to finish before they end with an error",
    )


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    """What the OpenAI surface adds to the model: sampling defaults, templates, parsers, access."""
    g = p.add_argument_group("serving (docs/serving.md)")
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for parameters a request omits, as vLLM: `auto` reads the model's "
        "generation_config.json, `vllm` ignores it (temperature 1, top_p 1), or a directory / JSON file",
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="JSON object merged over those defaults, e.g. '{\"temperature\": 0.6}'",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file, a built-in (deepseek-v3, deepseek-r1, deepseek-v4), or the "
        "template itself; default: the tokenizer's, else the built-in for a DeepSeek model",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="how tool calls are written (SGLang's names): deepseekv3, deepseekv31, deepseekv4, hermes "
        "(also qwen25); default: deepseekv3 / deepseekv4 for those models, hermes for the rest",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=["deepseek-r1", "deepseek-v3"],
        default=None,
        help="separate <think>...</think> into reasoning_content: deepseek-r1 (the output starts in "
        "the reasoning) or deepseek-v3 (only when chat_template_kwargs.thinking is on)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and the page's files",
    )
    g.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        metavar="ORIGINS",
        help="comma-separated origins (e.g. http://localhost:5173, or *) whose browsers may call the "
        "API (CORS); default: none",
    )


def _origins(text: str) -> list[str]:
    return [o.strip().rstrip("/") for o in text.split(",") if o.strip()]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = set(ServerConfig.__struct_fields__)
    return ServerConfig(**{k: v for k, v in vars(args).items() if k in fields})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit", description="Conduit LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=30000, help="port to listen on")
    s.add_argument(
        "--kernels",
        action="store_true",
        help="print which implementation each kernel op uses on --device, then exit",
    )
    add_engine_flags(s)
    add_serving_flags(s)
    add_http_flags(s)
    add_disaggregation_flags(s)

    g = sub.add_parser(
        "generate",
        help="generate offline (the same actors, no HTTP)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g.add_argument("prompt", nargs="+", help="prompt text(s)")
    g.add_argument("--chat", action="store_true", help="treat each prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    add_engine_flags(g)

    from runtime.http.gateway.config import add_gateway_flags

    gw = sub.add_parser(
        "gateway",
        help="one address in front of many `conduit serve` replicas (docs/gateway.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_gateway_flags(gw)

    c = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model directory")
    c.add_argument("gguf", help="path of the .gguf file")
    c.add_argument("out", help="output directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from runtime.logging import setup_logging

    setup_logging()
    if args.command == "serve" and args.kernels:
        from runtime.gpu.kernels import registry

        for op, impl in registry.describe(args.device).items():
            print(f"{op:24s} {impl}")
        return 0
    if args.command == "serve":
        import uvloop

        from runtime.server import PortInUse, serve

        cfg = config_from_args(args)
        if cfg.node_rank > 0:  # another machine's ranks: no HTTP here (runtime/actors/nodes.py)
            from runtime.actors.nodes import run_node_agent

            try:
                uvloop.run(run_node_agent(cfg))
            except (FileNotFoundError, ValueError) as e:
                print(f"conduit: {e}", file=sys.stderr)
                return 2
            return 0
        try:
            uvloop.run(serve(cfg))
        except (FileNotFoundError, PortInUse) as e:
            print(f"conduit: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before the server's own signal handling was installed
            return 130
        return 0
    if args.command == "gateway":
        import uvloop

        from runtime.http.gateway import gateway_config_from_args, serve_gateway

        uvloop.run(serve_gateway(gateway_config_from_args(args)))
        return 0
    if args.command == "generate":
        from runtime.engine import Engine
        from runtime.mailbox.messages import SamplingParams

        cfg = config_from_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat else args.prompt
        with Engine(**{f: getattr(cfg, f) for f in ServerConfig.__struct_fields__}) as engine:
            for out in engine.generate(prompts, params):
                print(out.text)
        return 0
    if args.command == "convert":
        from runtime.gpu.convert import convert_gguf

        try:
            print(convert_gguf(args.gguf, args.out))
        except (OSError, ValueError) as e:
            print(f"conduit convert: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
