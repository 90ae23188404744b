"""`loadgen steps`: engine step benchmarks without HTTP, on the model runner directly.

Decode: B requests registered with C distinct cached KV slots each (context C without prefilling),
then timed steps that each add k+1 tokens per request (k=0: plain decode, use_last; k>0: k draft
tokens verified: with `--draft-mode verify`, the default, real verify steps of a runner that speculates
with the n-gram drafter, so they replay verify CUDA graphs where the backend has them and sample every
position; `extend`: the k+1 tokens fed as a plain extend, for models that cannot speculate yet).
Prefill: one request with N new tokens on top of C cached ones. The same run measures
the device's copy bandwidth and matmul peak and reports

  MBU = (weight bytes + KV bytes read) / step time / copy bandwidth
  MFU = (2 * non-embedding params * tokens + attention flops) / step time / matmul peak
        (the LM head counted only for the tokens the step samples: a prefill's last one)
  %roof = roofline / step time, roofline = max(FLOPs / matmul peak, bytes / copy bandwidth): the
        step's (and, as every layer is counted, each layer's) time at the ceilings measured in the run
  attention flops = 4 * layers * q_heads * head_dim * (keys each new token attends to); for
  DeepSeek-V4 only the keys it reads: the window, plus the selected (CSA) or all (HCA) compressed
  entries, plus the CSA indexer's scoring (`attention_flops`)

MoE models (`RoutedExperts` layers): a step reads only the experts its tokens route to, and each token
multiplies by top_k of them, so the weight bytes count the distinct experts per layer that the point's
tokens reached (`expert_reach`: its last step once more, eagerly, with hooks) and the params top_k
experts per token. `--routing balanced` (the default; layers/moe.py) sends each token to k experts drawn
uniformly, as a trained router's even load; `--routing model` keeps the dummy weights' own routing, which
sends a step's tokens to a few experts, and more of them as the step grows.

On CUDA the KV pool is what `--mem-fraction-static` of the memory leaves after the weights; a run whose
points need more slots than that stops before its first step, with the numbers.

Decode steps are timed as the GPU worker runs them with overlap on (`--overlap on`, the default): step
i+1 is launched before step i's tokens are read back (two in flight, `ModelRunner.launch`), so the step
time is the device's period per step and the host work of building the next step hides behind the
current one. `--overlap off` (rows `decode-s`) waits for every step before launching the next.

Weights and KV are random (`--load-format dummy`), so only the timings mean anything. Cached contexts
are never computed: rows start on slots of random KV in a step of no tokens, and per-row model state
(DeepSeek-V4's window rings and compressor tails, which need `--page-size` a multiple of the largest
compression rate) starts at position 0 with meaningless values."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from loadgen.errors import LoadgenError


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_args(p) -> None:
    p.add_argument("--model-path", "--model",
                   help="HF model directory (config.json is enough with dummy weights) or a preset name "
                   "(llama-3.1-8b); default: a tiny Llama config")  # fmt: skip
    p.add_argument("--load-format", choices=("dummy", "auto"), default="dummy")
    p.add_argument("--routing", choices=("model", "balanced"), default="balanced",
                   help="MoE routing: balanced (the default: each token to k experts drawn uniformly, as a "
                   "trained router's even load) or model (the router's choice; on dummy weights it sends a "
                   "step's tokens to a few experts, so a step reads less than a real checkpoint's)")  # fmt: skip
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="CUDA: the share of the GPU's memory for weights and the KV pool (as conduit serve; "
                   "default: the runner's); the run stops at once if the pool left cannot hold its rows")  # fmt: skip
    p.add_argument("--quantization", choices=("auto", "none", "fp8"), default="auto",
                   help="DeepSeek-V2/V3/V4 weights: fp8 keeps (or with dummy weights makes) FP8 block-scaled "
                   "weights (V4: and FP4 experts, as stored), none dequantizes; auto: fp8 for an FP8 "
                   "checkpoint on cuda")  # fmt: skip
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help="JSON merged into config.json, e.g. '{\"num_hidden_layers\": 8}' (as conduit serve)")  # fmt: skip
    p.add_argument("--attention-backend", help="torch | triton; default: triton on cuda, torch on cpu")
    p.add_argument(
        "--batch-sizes", type=_ints, default=[8, 16, 32, 64, 128, 256], help="decode B, comma-separated"
    )
    p.add_argument("--context-len", type=int, default=2048, help="decode context C per request")
    p.add_argument(
        "--draft-tokens", type=_ints, default=[0], help="k draft tokens verified per step, e.g. 0,3"
    )
    p.add_argument("--accept-len", type=float, default=3.25, help="mean tokens accepted per step when k > 0")
    p.add_argument(
        "--draft-mode",
        choices=("verify", "extend"),
        default="verify",
        help="k > 0: real verify steps (a speculating runner) or the k+1 tokens as an extend",
    )
    p.add_argument("--speculative-algorithm", choices=("ngram", "mtp", "dspark"), default="ngram",
                   help="the drafter of the verify steps' runner (mtp: the model's nextn layer, drafting "
                   "just before each verify step; dspark: randomly initialised unless the checkpoint has it)")  # fmt: skip
    p.add_argument("--drafting", choices=("on", "off"), default="on",
                   help="k=0 steps of a speculating runner (--draft-tokens 0,k): the drafter drafts after "
                   "each (on), or only records its tokens (off: StepPlan.propose false, what the scheduler "
                   "sends once every row's speculation has switched itself off)")  # fmt: skip
    p.add_argument("--prefill-tokens", type=_ints, default=[4096, 8192, 16384], help="N new tokens per step")
    p.add_argument("--prefill-context", type=int, default=0, help="C cached tokens under the prefill")
    p.add_argument("--steps", type=int, default=10, help="timed steps per point (median reported)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each decode or prefill point's timed steps, run this many more under the torch "
                   "profiler and print the kernels' device time per step (CUDA)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=1,
                   help="KV pool page size: each decode row's slots start on a page (MLA reads whole "
                   "64-token tiles through a page table when it is a multiple of 64)")  # fmt: skip
    p.add_argument("--cuda-graph", choices=("on", "off", "both"), default="on",
                   help="decode with CUDA graphs, eagerly, or both side by side (rows `decode-e`: eager)")  # fmt: skip
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP attention ranks (one process, and one GPU, each); with --ep-size the same: DEP. "
                   "Every rank runs the same steps; figures are per GPU, plus the all-to-all time")  # fmt: skip
    p.add_argument("--ep-size", type=int, default=1, help="experts split over this many ranks (= --dp-size)")
    p.add_argument("--moe-a2a-backend", choices=("auto", "all_to_all"), default="auto",
                   help="all_to_all: MoE layers through the expert-parallel exchange even on one GPU "
                   "(what the EP path costs; as conduit serve)")  # fmt: skip
    p.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                   help="decode steps pipelined two deep as the worker runs them, or each waited for "
                   "(rows `decode-s`), or both")  # fmt: skip


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass
class WeightCount:
    """A model's weights as a step uses them: dense ones read whole by every step and multiplied by every
    token; routed experts (per MoE layer: E experts of `expert_bytes` / `expert_params` each, top_k per
    token) read as far as the step's tokens reach them."""

    total_bytes: int
    dense_bytes: int
    dense_params: int  # matmul params outside the routed experts (the embedding only when tied)
    moe_layers: list[tuple[int, int, int, int]]  # (E, top_k, expert_bytes, expert_params)
    head_params: int  # the LM head's, vocab x hidden (in dense_params): only sampled tokens reach it

    @staticmethod
    def of(model, config) -> WeightCount:  # noqa: ANN001 - a torch module and its HF config
        from runtime.gpu.layers.moe import RoutedExperts

        params = {id(p): p for p in model.parameters()}
        total = sum(p.numel() * p.element_size() for p in params.values())
        top_k = getattr(config, "num_experts_per_tok", 0)
        moe, expert_ids = [], set()
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                own = {id(p): p for p in m.parameters()}
                expert_ids |= own.keys()
                size = sum(p.numel() * p.element_size() for p in own.values())  # with FP8/FP4 scales
                moe.append((m.num_experts, top_k, size // m.num_experts, m.params_per_expert))
        dense = [p for i, p in params.items() if i not in expert_ids]
        embed = config.vocab_size * config.hidden_size
        # the embedding is a lookup, not a matmul, unless tied to the LM head (then counted once, as the head)
        dense_params = sum(p.numel() for p in dense) - (0 if config.tie_word_embeddings else embed)
        dense_bytes = sum(p.numel() * p.element_size() for p in dense)
        return WeightCount(total, dense_bytes, dense_params, moe, config.vocab_size * config.hidden_size)

    @property
    def params_per_token(self) -> int:
        return self.dense_params + sum(k * params for _, k, _, params in self.moe_layers)

    def flops(self, tokens: int, sampled: int) -> float:
        """Weight matmul FLOPs of a step: every token through the layers, `sampled` of them through the
        LM head (the runner computes logits for those alone)."""
        return 2.0 * (self.params_per_token * tokens - self.head_params * (tokens - sampled))

    def bytes_read(self, tokens: int, reached: list[int] | None = None) -> float:
        """Weight bytes a step of `tokens` tokens reads: with `reached` (the distinct experts the step's
        routing chose, per MoE layer in module order, `expert_reach`), those experts; else the expected
        number under uniform routing."""
        if reached is not None:
            return self.dense_bytes + sum(
                n * size for n, (_, _, size, _) in zip(reached, self.moe_layers, strict=True)
            )
        experts = sum(e * (1 - (1 - k / e) ** tokens) * size for e, k, size, _ in self.moe_layers)
        return self.dense_bytes + experts


def expert_reach(runner, plan) -> list[int] | None:  # noqa: ANN001 - a ModelRunner and a StepPlan
    """The distinct routed experts per MoE layer (module order) that `plan`'s tokens are sent to, from one
    more step run eagerly with hooks on the experts' inputs (CUDA graph replays run no Python hooks).
    None for a dense model. Dummy weights route unlike uniform routing, usually to fewer experts, so
    MBU counts these rather than the uniform expectation."""
    from runtime.gpu.layers.moe import RoutedExperts

    layers = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
    if not layers:
        return None
    reached: dict[int, int] = {}

    def record(module, args) -> None:  # noqa: ANN001 - forward(x, weights, ids)
        reached[id(module)] = int(args[2].unique().numel())

    hooks = [m.register_forward_pre_hook(record) for m in layers]
    graphs = runner.graphs
    enabled = graphs.enabled if graphs is not None else None
    try:
        if graphs is not None:
            graphs.enabled = False
        runner.execute(plan)
    finally:
        for h in hooks:
            h.remove()
        if graphs is not None:
            graphs.enabled = enabled
    return [reached.get(id(m), 0) for m in layers]


@dataclass
class Row:
    phase: str
    batch: int  # requests (decode) or 1 (prefill)
    new_tokens: int  # tokens per step
    context: int
    k: int
    step_s: float
    tokens_per_s: float
    mbu: float
    mfu: float
    roof_s: float  # max(FLOPs / matmul peak, bytes / copy bandwidth)
    a2a_s: float = 0.0  # with several ranks: the step's all-to-all time (one more eager step, synced)


def measure_ceilings(torch, device, dtype) -> Ceilings:
    """Copy bandwidth (read + write bytes of a large copy) and dense matmul peak, best of a few runs."""
    cuda = device.type == "cuda"
    n_bytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    n = 8192 if cuda else 512
    mm_dtype = dtype if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    copy = _best(torch, device, lambda: dst.copy_(src))
    mm = _best(torch, device, lambda: torch.mm(a, b))
    return Ceilings(2 * n_bytes / copy, 2 * n**3 / mm)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(torch, device, fn, reps: int = 5) -> float:
    fn()
    _sync(torch, device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(torch, device)
        best = min(best, time.perf_counter() - t)
    return best


class _Bench:
    def __init__(self, args, torch):
        from runtime.config import RunnerConfig
        from runtime.gpu.model_runner import ModelRunner
        from runtime.gpu.models.llama.model import head_dim_of

        self.torch, self.args = torch, args
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and args.dp_size > 1:
            device = f"cuda:{getattr(args, 'rank', 0)}"
        max_b = max(args.batch_sizes) if args.batch_sizes else 1
        k_max = max(args.draft_tokens) if args.draft_tokens else 0
        grow = (args.warmup_steps + args.steps + args.profile_steps + 1) * (k_max + 1)
        page = args.page_size
        self.per_row = -(-(args.context_len + grow) // page) * page  # KV slots each decode row owns
        self.first_slot = page if page > 1 else 1  # slot 0 is padding; rows start on a page
        prefill_need = args.prefill_context + max(args.prefill_tokens, default=0)
        slots = self.first_slot + max(max_b * self.per_row, prefill_need)
        self.max_len = max(self.per_row, prefill_need) + 1
        cfg = RunnerConfig(model_path=args.model_path, device=device, dtype=args.dtype, load_format=args.load_format,
                           balanced_routing=args.routing == "balanced",
                           kv_cache_dtype=args.kv_cache_dtype, hf_overrides=args.hf_overrides,
                           quantization=args.quantization,
                           num_kv_slots=slots, max_reqs=max_b, max_model_len=self.max_len, seed=args.seed,
                           **self._mem_fraction(args),
                           cuda_graph=args.cuda_graph != "off", page_size=page,
                           attention_backend=args.attention_backend,
                           moe_a2a_backend=args.moe_a2a_backend, rank=getattr(args, "rank", 0),
                           world_size=args.dp_size, ep_size=args.ep_size,
                           dist_init_addr=getattr(args, "dist_init_addr", None),
                           **self._speculation(args, k_max))  # fmt: skip
        self.runner = ModelRunner(cfg)
        if self.runner.kv_pool.num_slots < slots:  # on CUDA the pool is what memory leaves after the weights
            raise LoadgenError(
                f"the KV pool holds {self.runner.kv_pool.num_slots} token slots and these points need {slots} "
                f"(batch {max_b} x {self.per_row} slots of context and growth, or the prefill's {prefill_need}): "
                "lower --batch-sizes or --context-len, or raise --mem-fraction-static"
            )
        if self.runner.page_size != page:  # DeepSeek-V4: a page holds whole compression windows
            multiple = self.runner.kv_pool.page_multiple
            raise LoadgenError(f"this model needs --page-size a multiple of {multiple}, got {page}")
        c = self.runner.config
        self.layers, self.q_heads, self.head_dim = c.num_hidden_layers, c.num_attention_heads, head_dim_of(c)
        self.weights = WeightCount.of(self.runner.model, c)
        self.kv_per_token = self.runner.kv_pool.bytes_per_token
        self.ceil = measure_ceilings(torch, self.runner.device, self.runner.dtype)
        self.step_no = 0
        self.live: list[int] = []
        self.rng = torch.Generator().manual_seed(args.seed)

    @staticmethod
    def _mem_fraction(args) -> dict:
        return {} if args.mem_fraction_static is None else {"mem_fraction_static": args.mem_fraction_static}

    @staticmethod
    def _speculation(args, k_max: int) -> dict:
        """Runner settings for real verify steps: the drafter, k_max drafts at most."""
        if k_max == 0 or args.draft_mode != "verify":
            return {}
        return {"speculative_algorithm": args.speculative_algorithm, "speculative_num_draft_tokens": k_max}

    def _plan(self, **kw):
        from runtime.mailbox.messages import StepPlan

        self.step_no += 1
        return StepPlan(step=self.step_no, **{"added": [], "released": [], **kw})

    def _ids(self, n: int) -> list[int]:
        return self.torch.randint(3, self.runner.vocab_size, (n,), generator=self.rng).tolist()

    def _time(self, plans) -> float:
        """Median wall time of execute() over the timed plans (execute returns host tokens, so it syncs)."""
        times = []
        for i, plan in enumerate(plans):
            t = time.perf_counter()
            self.runner.execute(plan)
            _sync(self.torch, self.runner.device)
            if i >= self.args.warmup_steps:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def _time_pipelined(self, plans) -> float:
        """Mean period per step with two steps in flight (launch i+1, then read i's tokens), as the
        worker overlaps them; a median is meaningless here, so the timed steps are taken as one span."""
        pending: deque = deque()
        warm = self.args.warmup_steps
        t = time.perf_counter()
        for i, plan in enumerate(plans):
            if i == warm:
                while pending:
                    pending.popleft().result()
                _sync(self.torch, self.runner.device)
                t = time.perf_counter()
            pending.append(self.runner.launch(plan))
            if len(pending) > 1:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        _sync(self.torch, self.runner.device)
        return (time.perf_counter() - t) / (len(plans) - warm)

    def _register(self, rows: list[int], prefix: dict[int, list[int]]) -> None:
        """Start `rows` on the cached `prefix` slots (never computed: random KV), releasing the last ones,
        in a step of no tokens. Per-row model state that such a context never built (DeepSeek-V4's
        window rings and compressor tails) starts at position 0 with whatever the row's slices hold:
        the timed steps read it like a real context's, only the values are meaningless."""
        from runtime.mailbox.messages import SamplingParams, SeqStart

        greedy = SamplingParams(temperature=0.0)
        added = [SeqStart(r, greedy, [], prefix[r], []) for r in rows]
        released, self.live = self.live, list(rows)
        self.runner.execute(self._plan(added=added, released=released, rows=[], prefix_lens=[], extend_lens=[],
                                       use_last=[], input_ids=[], out_loc=[], sample=[]))  # fmt: skip
        for r in rows:
            self.runner.kv_pool.reset_row(r, 0)

    def decode(self, b: int, k: int, graph: bool = True, overlap: bool = True) -> Row:
        if self.runner.graphs is not None:
            self.runner.graphs.enabled = graph
        c, n = self.args.context_len, k + 1
        base = {r: self.first_slot + (r - 1) * self.per_row for r in range(1, b + 1)}
        self._register(list(base), {r: list(range(s, s + c)) for r, s in base.items()})
        plans = []
        verify = k > 0 and self.args.draft_mode == "verify"
        timed = self.args.warmup_steps + self.args.steps
        for i in range(timed + self.args.profile_steps):
            ctx = c + i * n
            fed = k == 0 or verify  # the last token (and the drafts) come from the device tables
            plans.append(self._plan(
                rows=list(base), prefix_lens=[ctx] * b, extend_lens=[n] * b, use_last=[fed] * b,
                input_ids=[] if fed else self._ids(b * n),
                out_loc=[s + ctx + j for s in base.values() for j in range(n)], sample=[True] * b,
                draft_lens=[k] * b if verify else [], propose=k > 0 or self.args.drafting == "on",
            ))  # fmt: skip
        plans, profiled = plans[:timed], plans[timed:]
        t = self._time_pipelined(plans) if overlap else self._time(plans)
        from runtime.gpu.layers.expert_parallel import timed_exchanges

        with timed_exchanges() as a2a:
            reached = expert_reach(self.runner, plans[-1])  # (the last step once more, untimed)
        if profiled:
            self._profile(profiled, f"decode B={b} k={k}")
        ctx = c + (self.args.warmup_steps + self.args.steps / 2) * n  # mean context over the timed steps
        kv_read = b * ctx * self.kv_per_token
        sampled = b * n if k == 0 or verify else b  # verify steps sample every position
        flops = self.weights.flops(b * n, sampled) + self._attn_flops(ctx, n) * b
        tok = b * (1 if k == 0 else self.args.accept_len) / t
        phase = "decode" if graph or self.runner.graphs is None else "decode-e"
        phase += "" if overlap else "-s"
        weights = self.weights.bytes_read(b * n, reached)
        return self._row(phase, b, b * n, c, k, t, weights + kv_read, flops, tok, a2a.seconds)

    def _profile(self, plans, title: str) -> None:
        """The kernels of `plans`, run one at a time under the profiler (CUPTI sees graph replays' kernels)."""
        from torch.profiler import ProfilerActivity, profile

        from loadgen.kernel_table import kernel_table

        cuda = self.runner.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for plan in plans:
                self.runner.execute(plan)
            _sync(self.torch, self.runner.device)
        print(f"{title}, {len(plans)} profiled steps:\n{kernel_table(prof, len(plans), cuda)}", flush=True)

    def prefill(self, n: int) -> Row:
        c, base = self.args.prefill_context, self.first_slot  # position p at slot base + p
        self._register([1], {1: list(range(base, base + c))})
        plans = []
        timed = self.args.warmup_steps + self.args.steps
        for _ in range(timed + self.args.profile_steps):  # the same chunk, rewritten each time
            plans.append(self._plan(rows=[1], prefix_lens=[c], extend_lens=[n], use_last=[False],
                                    input_ids=self._ids(n), out_loc=list(range(base + c, base + c + n)),
                                    sample=[True]))  # fmt: skip
        plans, profiled = plans[:timed], plans[timed:]
        t = self._time(plans)
        if profiled:
            self._profile(profiled, f"prefill N={n} C={c}")
        from runtime.gpu.layers.expert_parallel import timed_exchanges

        with timed_exchanges() as a2a:
            weights = self.weights.bytes_read(n, expert_reach(self.runner, plans[-1]))
        kv_read = (c + n) * self.kv_per_token
        flops = self.weights.flops(n, 1) + self._attn_flops(c, n)
        return self._row("prefill", 1, n, c, 0, t, weights + kv_read, flops, n / t, a2a.seconds)

    def _attn_flops(self, ctx: float, n: int) -> float:
        return attention_flops(self.runner.config, self.layers, self.q_heads, self.head_dim, ctx, n)

    def _row(self, phase, b, n, c, k, t, bytes_read, flops, tok, a2a_s=0.0) -> Row:
        mbu = bytes_read / t / self.ceil.copy_bytes_per_s
        mfu = flops / t / self.ceil.matmul_flops_per_s
        roof = max(bytes_read / self.ceil.copy_bytes_per_s, flops / self.ceil.matmul_flops_per_s)
        return Row(phase, b, n, c, k, t, tok, mbu, mfu, roof, a2a_s)


def attention_flops(config, layers: int, q_heads: int, head_dim: int, ctx: float, n: int) -> float:  # noqa: ANN001
    """Attention FLOPs of n new tokens after ctx cached ones, causal: token i attends ctx + i + 1 keys
    (QK^T and PV, 4 x heads x head_dim per key). DeepSeek-V4 (`layer_types`) counts only the entries a
    token attends: its sliding window on every layer, plus on a CSA layer the `index_topk` compressed
    entries the indexer picks (and the indexer's scoring of every compressed entry), on an HCA layer
    every compressed entry; so MFU is not inflated by keys the model never reads."""
    types = getattr(config, "layer_types", None)  # a transformers config: V4's has per-layer types
    if not types or not hasattr(config, "compress_rates"):
        keys = n * ctx + n * (n + 1) / 2
        return 4 * layers * q_heads * head_dim * keys
    import numpy as np

    seen = ctx + np.arange(1, n + 1, dtype=np.float64)  # token i sees the positions before ctx + i + 1
    window, rates = np.minimum(config.sliding_window, seen), config.compress_rates
    total = 0.0
    for layer_type in types[:layers]:
        keys = window
        rate = rates.get(layer_type)
        if rate is not None:
            entries = np.floor(seen / rate)
            if layer_type == "compressed_sparse_attention":
                keys = keys + np.minimum(config.index_topk, entries)
                total += 2 * config.index_n_heads * config.index_head_dim * entries.sum()  # the indexer
            else:
                keys = keys + entries
        total += 4 * q_heads * head_dim * keys.sum()
    return float(total)


def table(rows: list[Row], bench: _Bench) -> str:
    r = bench.runner
    head = [
        f"model {bench.args.model_path} ({bench.args.load_format}"
        f"{', balanced routing' if r.cfg.balanced_routing else ''}), {r.device}, {r.dtype}, "
        f"weights {bench.weights.total_bytes / 1e9:.3f} GB, KV {bench.kv_per_token} B/token ({r.kv_dtype})",
        f"measured: copy {bench.ceil.copy_bytes_per_s / 1e9:.1f} GB/s, matmul {bench.ceil.matmul_flops_per_s / 1e12:.2f} "
        f"TFLOP/s; {bench.args.steps} timed steps per point (decode overlapped: mean period; else median)",
        f"{'phase':<11}{'B':>5}{'tok/step':>9}{'ctx':>8}{'k':>3}{'step ms':>10}{'tok/s':>12}{'MBU':>8}{'MFU':>8}"
        f"{'roof ms':>10}{'layer ms':>10}{'%roof':>7}",
    ]
    ranks = bench.args.dp_size
    if ranks > 1:
        head.insert(0, f"DP={ranks} EP={bench.args.ep_size}: every figure is per GPU (rank 0's); a2a ms: the "
                       "step's all-to-all time, from one more eager step synced around each exchange")  # fmt: skip
        head[-1] += f"{'a2a ms':>9}"
    lines = [*head, "-" * len(head[-1])]
    for x in rows:
        lines.append(f"{x.phase:<11}{x.batch:>5}{x.new_tokens:>9}{x.context:>8}{x.k:>3}{x.step_s * 1e3:>10.3f}"
                     f"{x.tokens_per_s:>12.1f}{x.mbu:>8.2%}{x.mfu:>8.2%}{x.roof_s * 1e3:>10.3f}"
                     f"{x.roof_s * 1e3 / bench.layers:>10.3f}{x.roof_s / x.step_s:>7.1%}"
                     + (f"{x.a2a_s * 1e3:>9.3f}" if ranks > 1 else ""))  # fmt: skip
    lines.append(
        f"roof ms: the step at the measured ceilings, max(FLOPs / matmul, bytes / copy); layer ms: "
        f"that over the {bench.layers} layers; %roof: roof / step"
    )
    if any(x.phase == "decode-e" for x in rows):
        lines.append("decode-e: the same decode steps run eagerly (CUDA graphs off)")
    if any(x.phase.endswith("-s") for x in rows):
        lines.append("-s: each step waited for before the next is launched (no overlap)")
    if any(x.k for x in rows):
        lines.append(f"k > 0: tok/s = B x accept length {bench.args.accept_len} / step time")
    if bench.weights.moe_layers:
        lines.append(
            "MBU counts the routed experts each point's tokens reached (one more step, eager, hooked)"
        )
    return "\n".join(lines)


def main(args) -> int:
    try:
        import torch  # noqa: F401 (present, or a clear error here)
    except ImportError:
        raise LoadgenError("loadgen steps needs torch") from None
    if args.steps < 1 or args.warmup_steps < 0:
        raise LoadgenError("--steps must be >= 1 and --warmup-steps >= 0")
    if args.dp_size > 1 or args.ep_size > 1:
        return _main_ranks(args)
    return _main_rank(args)


def _main_ranks(args) -> int:
    """DEP: one process per rank (spawned; NCCL on CUDA, gloo on the CPU), each running the same steps so
    their MoE exchanges line up; rank 0 prints the table."""
    import multiprocessing as mp
    import socket

    if args.dp_size != args.ep_size:
        raise LoadgenError("--dp-size and --ep-size must be equal (DP attention with expert parallelism)")
    if args.model_path is None:
        raise LoadgenError("--dp-size/--ep-size need a MoE --model-path (DeepSeek)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(args.dp_size):
        rank_args = argparse.Namespace(**vars(args), rank=rank, dist_init_addr=f"127.0.0.1:{port}")
        procs.append(ctx.Process(target=_rank_entry, args=(rank_args,)))
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise LoadgenError(f"ranks {bad} failed (their errors are above)")
    return 0


def _rank_entry(args) -> None:
    import sys

    if args.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process ends with it)
    _main_rank(args)


def _main_rank(args) -> int:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path is None:
            from runtime.gpu.testing import tiny_llama_config

            tiny_llama_config(max_position_embeddings=1 << 20).save_pretrained(tmp)
            args.model_path = tmp
        try:
            bench = _Bench(args, torch)
        except (FileNotFoundError, ValueError) as e:
            raise LoadgenError(str(e)) from None
        except torch.OutOfMemoryError:
            raise LoadgenError(
                "out of device memory for the KV slots: lower --batch-sizes or --context-len"
            ) from None
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.cuda_graph]
        overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
        rows = [
            bench.decode(b, k, g, o)
            for k in args.draft_tokens
            for b in args.batch_sizes
            for g in modes
            for o in overlaps
        ]
        rows += [bench.prefill(n) for n in args.prefill_tokens]
        print(table(rows, bench))
    return 0
