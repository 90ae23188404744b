"""The tensor side of one worker: weights, KV cache, request table, forward and sampling of a step.

`execute(plan)` is the whole contract with the scheduler (see `StepPlan`). Per step the host builds
all index tensors in one packed int64 tensor and moves it with one copy; rows that feed back their
last sampled token (`use_last`) read it from the device table `last_token`, so a plan can be sent
before the previous step's tokens reach the host.

Decode steps (every row one new token) run as CUDA graphs on CUDA (`runtime.gpu.cuda_graph`), unless
`cuda_graph` is off; the step's tokens come back through one device-to-host copy."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from runtime import envs
from runtime.gpu import compile_watch, loader, presets
from runtime.gpu.attention import default_backend, get_attention_backend
from runtime.gpu.cuda_graph import DecodeGraphs
from runtime.gpu.forward_batch import ForwardBatch, columns_to_device, token_positions
from runtime.gpu.kernels.fp8_gemm.linear import precompile as precompile_fp8_gemms
from runtime.gpu.kv_cache import KVCache
from runtime.gpu.layers import RotaryEmbedding
from runtime.gpu.layers.fp8_linear import weight_shapes as fp8_weight_shapes
from runtime.gpu.models import get_model_class
from runtime.gpu.models.llama import head_dim_of
from runtime.gpu.pending import PendingStep
from runtime.gpu.quant import fp8
from runtime.gpu.sampler import Sampler
from runtime.mailbox.messages import StepOutput, StepPlan

log = structlog.get_logger(__name__)


@dataclass
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str | None = None  # default float32 on cpu, bfloat16 on cuda
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype | "fp8_e4m3" (Llama and DeepSeek-V2/V3 pools)
    load_format: str = "auto"  # "auto" | "dummy"
    # FP8 block-scaled weights (DeepSeek-V2/V3, `quant.fp8.keep_fp8`): "auto" keeps an FP8 checkpoint's
    # on CUDA, "none" dequantizes, "fp8" keeps them (quantizing float or dummy weights at load)
    quantization: str = "auto"
    num_kv_slots: int = 16384  # including slot 0 (padding)
    max_reqs: int = 256  # rows of req_to_token; row 0 is padding, rows 1..max_reqs usable
    max_model_len: int = 8192
    page_size: int = 1
    seed: int = 0
    attention_backend: str | None = None  # None: "triton" on CUDA when Triton imports, else "torch"
    cuda_graph: bool = True  # decode steps as CUDA graphs (CUDA only; needs a graph-safe backend)
    cuda_graph_max_bs: int | None = None  # largest captured batch; None: max_reqs
    # torch intra-op threads for CPU runs (process-wide); None leaves torch's default. On a small, busy
    # machine 1 thread is far faster: with 2 threads on 2 shared cores every op waits on a barrier.
    cpu_threads: int | None = None
    hf_overrides: dict | None = None  # merged into config.json (ServerConfig.hf_overrides)
    # Prefix-cache hits on models with per-request state outside the pages (DeepSeek-V4): tokens before
    # the hit to replay (None: the model's sliding window), or replay from position 0 (exact, slower).
    swa_replay_tokens: int | None = None
    swa_replay_exact: bool = False
    # the scheduler's prefill token budget per step (the chunked-prefill size): the warm-up runs one
    # step that large, so the first real one does not pay for its allocations and kernel variants
    max_prefill_tokens: int | None = None


def _resolve_dtype(cfg: RunnerConfig) -> torch.dtype:
    if cfg.dtype is None:
        return torch.bfloat16 if torch.device(cfg.device).type == "cuda" else torch.float32
    dt = getattr(torch, cfg.dtype.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {cfg.dtype!r}")
    return dt


def _resolve_kv_dtype(cfg: RunnerConfig, dtype: torch.dtype) -> torch.dtype:
    if cfg.kv_cache_dtype == "auto":
        return dtype
    if cfg.kv_cache_dtype in ("fp8_e4m3", "fp8"):
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv_cache_dtype {cfg.kv_cache_dtype!r} (auto, fp8_e4m3)")


def _eos_ids(model_path: Path, config) -> list[int]:
    ids = None
    gen = model_path / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class ModelRunner:
    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = _resolve_dtype(cfg)
        if cfg.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        if self.device.type == "cuda":
            compile_watch.install()
        path = Path(presets.resolve(cfg.model_path))
        self.config = loader.load_config(path, cfg.hf_overrides)
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids: list[int] = _eos_ids(path, self.config)
        self.model = self._load_model(path)
        # what compute_logits returns (the CUDA graphs' logits buffer): float32 unless the model says
        self.logits_dtype: torch.dtype = getattr(self.model, "logits_dtype", torch.float32)
        # False for models whose per-request state cannot start from a cached prefix (DeepSeek-V4's
        # sliding-window and compressor state): the engine then runs without the radix cache.
        self.supports_prefix_cache: bool = getattr(self.model, "supports_prefix_cache", True)

        backend = cfg.attention_backend or default_backend(self.device)
        self.kv_dtype = _resolve_kv_dtype(cfg, self.dtype)
        if hasattr(self.model, "make_kv_cache"):  # models with their own KV layout (MLA's latent cache)
            if self.kv_dtype != self.dtype and not getattr(self.model, "supports_fp8_kv_cache", False):
                raise ValueError(
                    f"--kv-cache-dtype {cfg.kv_cache_dtype} is supported for Llama-family and DeepSeek-V2/V3"
                    f" models, not {type(self.model).__name__}"
                )
            rows = cfg.max_reqs + 1  # as req_to_token's (V4 allocates its per-row state for them)
            self.kv_cache = self.model.make_kv_cache(cfg.num_kv_slots, self.kv_dtype, self.device, rows)
            self.attn_backend = self.model.make_attention_backend(backend)
        else:
            n_layers, hd = self.config.num_hidden_layers, head_dim_of(self.config)
            n_kv = self.model.num_kv_heads
            self.kv_cache = KVCache(n_layers, cfg.num_kv_slots, n_kv, hd, self.kv_dtype, self.device)
            self.attn_backend = get_attention_backend(backend)(
                self.config.num_attention_heads, n_kv, hd, scale=hd**-0.5
            )
        self.attn_backend.page_size = cfg.page_size
        # Models with per-request state outside the paged pool (V4's window ring and compressor tails)
        # rebuild it on a prefix hit by replaying this many tokens before the hit (StepPlan.replay), and
        # need page sizes that are multiples of `page_multiple` (V4: whole compression windows per page).
        replay_tokens = getattr(self.kv_cache, "replay_tokens", None)
        self.prefix_replay = (
            replay_tokens(cfg.swa_replay_tokens, cfg.swa_replay_exact) if replay_tokens else 0
        )
        self.page_multiple: int = getattr(self.kv_cache, "page_multiple", 1)
        self._check_layout = getattr(self.kv_cache, "check_plan", None)
        rows = cfg.max_reqs + 1
        self.req_to_token = torch.zeros(rows, cfg.max_model_len, dtype=torch.int64, device=self.device)
        self.last_token = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.sampler = Sampler(cfg.max_reqs, self.vocab_size, self.device, cfg.seed)
        self._t_ref: torch.cuda.Event | None = None
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graph and self.device.type == "cuda" and self.attn_backend.supports_cuda_graph:
            self.graphs = DecodeGraphs(self, min(cfg.cuda_graph_max_bs or cfg.max_reqs, cfg.max_reqs))
        if self.device.type == "cuda" and not hasattr(self.model, "make_kv_cache"):
            self.warm_up_mixed_steps()
        if self.device.type == "cuda":
            compile_watch.mark_serving()

    def _load_model(self, path: Path) -> torch.nn.Module:
        # Build on the meta device so no time goes into random init that loading overwrites.
        cls = get_model_class(self.config)
        with torch.device("meta"):
            model = cls(self.config, max_positions=self.cfg.max_model_len, **self._quant_kwargs(cls))
        model = model.to(self.dtype).to_empty(device=self.device)
        model.tie_weights()
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):  # derived tables: recompute (in float32) on the device
                m.build(self.device)
        if self.cfg.load_format == "dummy":
            loader.init_dummy_weights(model, self.cfg.seed)
        elif self.cfg.load_format == "auto":
            tensors = loader.iter_tensors(loader.safetensors_files(path))
            if hasattr(model, "load_weights"):  # models with their own name mapping / quantized formats
                model.load_weights(tensors)
            else:
                loader.load_weights(model, tensors)
        else:
            raise ValueError(f"unknown load_format {self.cfg.load_format!r} (auto | dummy)")
        if hasattr(model, "fold_norms") and envs.fold_norms():  # Llama: norms into the next projections
            model.fold_norms()
        t0 = time.perf_counter()
        if lines := precompile_fp8_gemms(fp8_weight_shapes(model), self.dtype, self.device):
            failed = [ln for ln in lines if ln.startswith("FAILED")]
            log.info(
                "fp8 GEMM kernels compiled", kernels=len(lines), seconds=round(time.perf_counter() - t0, 1)
            )
            for line in failed:  # those shapes compile (or fail) on their first call instead
                log.warning("fp8 GEMM kernel did not compile", detail=line)
        return model.eval().requires_grad_(False)

    def _quant_kwargs(self, cls: type) -> dict:
        """`fp8_weights=True` for a model that keeps FP8 weights under `quantization`."""
        mode = self.cfg.quantization
        fp8.check_quantization(mode)  # also for models that never keep FP8 weights
        if not getattr(cls, "supports_fp8_weights", False):
            if mode == "fp8":
                raise ValueError(f"--quantization fp8 is supported for DeepSeek-V2/V3, not {cls.__name__}")
            return {}
        return {"fp8_weights": True} if fp8.keep_fp8(mode, self.config, self.device) else {}

    def kv_bytes_per_token(self) -> int:
        if hasattr(self.model, "kv_bytes_per_token"):
            return self.model.kv_bytes_per_token(self.kv_dtype)
        return KVCache.bytes_per_token(
            self.config.num_hidden_layers, self.model.num_kv_heads, head_dim_of(self.config), self.kv_dtype
        )

    def warm_up_mixed_steps(self) -> None:
        """Run throwaway prefill and mixed steps so the kernels they launch compile now, not under the
        first burst of requests (a second or so each on the H200). The attention backend starts every
        per-row column 16-byte aligned, so each kernel compiles one variant per launch shape: here the
        decode kernel on a mixed step's leading rows (0-2 of them), and the prefill kernel on rows with
        and without a cached prefix, in its short- and, where the model allows, long-row launch; last,
        one step as large as the scheduler's prefill budget (`_full_step_shape`). On the H200 a
        machine's first server lost about 2 s to compiles at its first steps before there was a
        warm-up (docs/PERF.md, eighth session). The rows and the first KV slots it uses are scratch
        until requests take them: a request writes its KV before it reads it."""
        if self.cfg.max_reqs < 4 or self.cfg.num_kv_slots < 40:
            return
        # (decode rows, their cached prefixes, prefill rows: their cached prefix and new tokens)
        shapes = [
            (n_dec, [1] * n_dec, [(0, 16)] + [(1, 16)] * (n_ext - 1))
            for n_dec in (0, 1, 2)
            for n_ext in (1, 2)
        ]
        long_row = 2 * 1024 + 1  # past the prefill kernel's short-row launch
        if self.cfg.max_model_len > long_row + 1 and self.cfg.num_kv_slots > long_row + 8:
            shapes += [(0, [], [(0, long_row)]), (0, [], [(1, long_row)])]
        if full := self._full_step_shape():
            shapes.append(full)
        for n_dec, dec_prefix, prefills in shapes:
            rows = list(range(1, n_dec + len(prefills) + 1))
            prefix = dec_prefix + [p for p, _ in prefills]
            ext = [1] * n_dec + [e for _, e in prefills]
            plan = StepPlan(
                step=-1, added=[], released=[], rows=rows, prefix_lens=prefix, extend_lens=ext,
                use_last=[False] * len(rows), input_ids=[0] * sum(ext), out_loc=list(range(1, sum(ext) + 1)),
                sample=[True] * len(rows),
            )  # fmt: skip
            self.forward_logits(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _full_step_shape(self) -> tuple[int, list[int], list[tuple[int, int]]] | None:
        """The warm-up's largest step, as a mixed step of a serving run looks: two decode rows with long
        contexts (the decode kernel's multi-split launch) beside `max_prefill_tokens` of prefill in rows
        of up to 1024 tokens, the first continuing a cached prefix. It leaves the first full-size step of
        a run its own work only: no first allocations of its activations, no launch shape seen for the
        first time. None when it would not fit or adds nothing over the warm-up's other shapes."""
        cfg = self.cfg
        total = min(cfg.max_prefill_tokens or 0, cfg.num_kv_slots - 16)
        row_len = min(1024, cfg.max_model_len - 2)
        if total <= 2 * 1024 + 1 or row_len < 64:
            return None
        n_rows = min(-(-total // row_len), cfg.max_reqs - 2)
        if n_rows < 2:
            return None
        sizes = [row_len] * (n_rows - 1) + [min(row_len, total - row_len * (n_rows - 1))]
        dec_prefix = min(2048, cfg.max_model_len - 2)
        return 2, [dec_prefix] * 2, [(1, sizes[0] - 1)] + [(0, n) for n in sizes[1:]]

    # ------------------------------------------------------------------ step

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueue the step's device work and the copy of its results; return without waiting for them.
        The worker launches step N+1 while N's results are still in flight (overlap scheduling)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            start = self._timing_event()
            logits, sample_rows, sample_rows_t = self._forward_plan(plan)
            if not sample_rows:
                return PendingStep(plan.step, [], [], None, start, self._timing_event(), t0, self._t_ref)
            result = self.sampler.sample(logits, sample_rows, sample_rows_t)
            self.last_token[sample_rows_t] = result.tokens
            parts = [result.tokens, result.logprobs, result.top_ids, result.top_logprobs]
            copies = [None if t is None else t.to("cpu", non_blocking=True) for t in parts]
        return PendingStep(
            plan.step, sample_rows, copies, result.top_counts, start, self._timing_event(), t0, self._t_ref
        )

    def _timing_event(self) -> torch.cuda.Event | None:
        """A recorded CUDA event (None on CPU). The first one is the reference the step times count from,
        so the scheduler can see the device's idle gaps between steps."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if self._t_ref is None:
            self._t_ref = ev
        return ev

    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of the sampled rows, without sampling (for tests and scoring)."""
        with torch.inference_mode():
            # a copy: a graph's logits buffer is reused next step
            return self._forward_plan(plan)[0].to(torch.float32, copy=True)

    def _forward_plan(self, plan: StepPlan) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        _check_plan(plan, self.cfg)
        if self._check_layout is not None:
            self._check_layout(plan)
        self._update_table(plan)
        sample_rows = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        if not plan.rows:
            return torch.empty(0, self.vocab_size, device=self.device), [], self.last_token[:0]
        if self.graphs is not None and self.graphs.fits(plan):
            logits, rows_t = self.graphs.run(plan)
            return logits, sample_rows, rows_t
        batch, last_idx, sample_rows_t = self._build_batch(plan)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[last_idx]), sample_rows, sample_rows_t

    def _update_table(self, plan: StepPlan) -> None:
        release_state = getattr(self.kv_cache, "release", None)  # per-request model state (V4)
        for row in plan.released:
            self.sampler.release(row)
            if release_state is not None:
                release_state(row)
        for start in plan.added:
            if start.prefix_slots and not self.supports_prefix_cache:
                raise ValueError(
                    f"row {start.row} starts with a cached prefix, which {type(self.model).__name__} "
                    "cannot reuse (serve it with the radix cache off)"
                )
            if start.prefix_slots:
                slots = torch.tensor(start.prefix_slots, dtype=torch.int64)
                self.req_to_token[start.row, : len(start.prefix_slots)] = slots.to(self.device)
            self.sampler.register(start)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        ext = torch.tensor(plan.extend_lens, dtype=torch.int64)
        rows = torch.tensor(plan.rows, dtype=torch.int64)
        use_last = torch.tensor(plan.use_last, dtype=torch.bool)
        positions, starts = token_positions(plan.prefix_lens, plan.extend_lens)
        num_tokens = len(positions)
        tok_row = torch.repeat_interleave(rows, ext)
        ids = torch.zeros(num_tokens, dtype=torch.int64)
        ids[~torch.repeat_interleave(use_last, ext)] = torch.tensor(plan.input_ids, dtype=torch.int64)
        sample = torch.tensor(plan.sample, dtype=torch.bool)
        last_idx = (starts + ext - 1)[sample]
        sample_rows = rows[sample]
        last_rows = rows[use_last]
        last_pos = starts[use_last]
        # aligned columns: with them packed end to end, an odd token count shifted the positions the
        # RoPE kernel reads and compiled a new variant mid-run
        cols = [ids, positions, plan.out_loc, tok_row, last_idx, sample_rows, last_rows, last_pos, rows]
        ids_d, pos_d, loc_d, tok_row_d, last_idx_d, sample_rows_d, last_rows_d, last_pos_d, rows_d = (
            columns_to_device(cols, self.device)
        )
        if len(last_rows):
            ids_d = ids_d.clone()
            ids_d[last_pos_d] = self.last_token[last_rows_d]
        self.req_to_token[tok_row_d, pos_d] = loc_d
        batch = ForwardBatch(
            input_ids=ids_d,
            positions=pos_d,
            out_loc=loc_d,
            rows=rows_d,
            rows_list=list(plan.rows),
            prefix_lens=list(plan.prefix_lens),
            extend_lens=list(plan.extend_lens),
            req_to_token=self.req_to_token,
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
            replay_lens=list(plan.replay),
        )
        self.attn_backend.prepare(batch)
        return batch, last_idx_d, sample_rows_d


def _check_plan(plan: StepPlan, cfg: RunnerConfig) -> None:
    """Host-side checks that turn a malformed plan into a clear error instead of a device fault."""
    n = len(plan.rows)
    cols = (plan.prefix_lens, plan.extend_lens, plan.use_last, plan.sample)
    if any(len(c) != n for c in cols):
        raise ValueError(f"step {plan.step}: per-row columns differ in length from rows ({n})")
    if len(plan.out_loc) != sum(plan.extend_lens):
        raise ValueError(
            f"step {plan.step}: {len(plan.out_loc)} out_loc for {sum(plan.extend_lens)} new tokens"
        )
    fed = sum(e for e, last in zip(plan.extend_lens, plan.use_last, strict=True) if not last)
    if len(plan.input_ids) != fed:
        raise ValueError(
            f"step {plan.step}: {len(plan.input_ids)} input_ids for {fed} tokens without use_last"
        )
    for row, p, e, last in zip(plan.rows, plan.prefix_lens, plan.extend_lens, plan.use_last, strict=True):
        if not 0 < row <= cfg.max_reqs:
            raise ValueError(f"step {plan.step}: row {row} outside 1..{cfg.max_reqs}")
        if last and e != 1:
            raise ValueError(f"step {plan.step}: row {row} uses its last token but extends by {e}")
        if p + e > cfg.max_model_len:
            raise ValueError(f"step {plan.step}: row {row} reaches {p + e} tokens > max_model_len")
    if plan.replay:  # replayed tokens come first in a row and leave at least one new token
        if len(plan.replay) != n or any(
            not 0 <= r < e for r, e in zip(plan.replay, plan.extend_lens, strict=True)
        ):
            raise ValueError(
                f"step {plan.step}: replay needs one count per row, each below its extend length"
            )
