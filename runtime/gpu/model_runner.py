"""The tensor side of one worker: weights, KV pool, request tables, forward and sampling of a step.

`launch(plan)` is the whole contract with the scheduler (see `StepPlan`), and `capabilities()` is what
the scheduler learns about the model and its pool at start-up. Per step the host builds all index
tensors in one packed int64 tensor and moves it with one copy; rows that feed back their last sampled
token (`use_last`) read it from the device table `last_token`, so a plan can be sent before the previous
step's tokens reach the host.

Decode steps (every row one new token) run as CUDA graphs on CUDA (`cuda_graph.GraphRunner`), unless
`cuda_graph` is off; the step's tokens come back through one device-to-host copy."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from runtime.config import RunnerConfig
from runtime.gpu import compile_watch, loader, presets
from runtime.gpu.attention import default_backend
from runtime.gpu.cuda_graph import GraphRunner
from runtime.gpu.forward_batch import ForwardBatch, StepTables, columns_to_device, make_batch, token_positions
from runtime.gpu.grammar import GrammarTable
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.model_builder import build_model, resolve_dtype, resolve_kv_dtype
from runtime.gpu.pending import PendingStep
from runtime.gpu.sampler import Sampler
from runtime.gpu.warm_up import warm_up
from runtime.mailbox.messages import StepOutput, StepPlan, WorkerCapabilities
from runtime.model_info import tokenizer_dir

if TYPE_CHECKING:
    from runtime.structured.grammar import GrammarCompiler

log = structlog.get_logger(__name__)


def _eos_ids(model_path: Path, config) -> list[int]:  # noqa: ANN001
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
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if cfg.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        if self.device.type == "cuda":
            compile_watch.install()
        path = Path(presets.resolve(cfg.model_path))
        self.config = loader.load_config(path, cfg.hf_overrides)
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids: list[int] = _eos_ids(path, self.config)
        self.model = build_model(cfg, self.config, path, self.device, self.dtype)

        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and not self.model.abilities.fp8_kv_cache:
            raise ValueError(
                f"--kv-cache-dtype {cfg.kv_cache_dtype} is supported for Llama-family and DeepSeek-V2/V3"
                f" models, not {type(self.model).__name__}"
            )
        rows = cfg.max_reqs + 1  # row 0 is padding
        spec = KVPoolSpec(cfg.num_kv_slots, rows, self.kv_dtype, self.device, cfg.max_model_len)
        self.kv_pool = self.model.make_kv_pool(spec)
        self.page_size = _page_size(cfg.page_size, self.kv_pool.page_multiple)
        self.attn = self.model.make_attention_backend(
            cfg.attention_backend or default_backend(self.device), self.page_size
        )
        # Models with per-request state outside the paged pool (V4's window ring and compressor tails)
        # rebuild it on a prefix hit by replaying this many tokens before the hit (StepPlan.replay).
        self.prefix_replay = self.kv_pool.replay_tokens(cfg.swa_replay_tokens, cfg.swa_replay_exact)
        self.tables = StepTables.allocate(rows, cfg.max_model_len, self.device)
        self.sampler = Sampler(cfg.max_reqs, self.vocab_size, self.device, cfg.seed)
        self.grammar = GrammarTable(self._grammar_compiler, self.vocab_size, self.device)
        self._t_ref: torch.cuda.Event | None = None
        self.graphs: GraphRunner | None = None
        if cfg.cuda_graph and self.device.type == "cuda" and self.attn.supports_cuda_graph:
            self.graphs = self.make_graphs(min(cfg.cuda_graph_max_bs or cfg.max_reqs, cfg.max_reqs))
        if self.device.type == "cuda" and self.attn.wants_warm_up:
            warm_up(cfg, self.forward_logits)
            torch.cuda.synchronize(self.device)
        if self.device.type == "cuda":
            compile_watch.mark_serving()

    def make_graphs(self, max_bs: int, capture: bool = True) -> GraphRunner:
        """Decode graphs over this runner's model, backend, pool and tables (`capture=False`: the padded
        static-buffer path run eagerly, as the CPU tests check it)."""
        return GraphRunner(
            self.model, self.attn, self.kv_pool, self.tables,
            max_bs=max_bs, max_model_len=self.cfg.max_model_len, vocab_size=self.vocab_size, capture=capture,
        )  # fmt: skip

    def _grammar_compiler(self) -> GrammarCompiler:
        """Structured output's compiler over this model's vocabulary (built on the first constrained
        request: it loads the tokenizer)."""
        from transformers import AutoTokenizer

        from runtime.structured.grammar import GrammarCompiler

        path = tokenizer_dir(self.cfg.tokenizer, self.cfg.model_path, self.cfg.load_format)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)

    def capabilities(self) -> WorkerCapabilities:
        """What the scheduler is configured from (sent once by the worker at start-up)."""
        cfg = self.cfg
        return WorkerCapabilities(
            rank=cfg.rank,
            model=type(self.model).__name__,
            num_kv_slots=self.kv_pool.num_slots,
            page_size=self.page_size,
            max_reqs=cfg.max_reqs,
            max_model_len=cfg.max_model_len,
            prefix_cache=self.model.abilities.prefix_cache,
            prefix_replay=self.prefix_replay,
            kv_bytes_per_token=self.kv_pool.bytes_per_token,
            vocab_size=self.vocab_size,
        )

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
            mask = self.grammar.mask(sample_rows) if self.grammar.rows else None  # waits for step N's tokens
            result = self.sampler.sample(logits, sample_rows, sample_rows_t, mask)
            self.tables.last_token[sample_rows_t] = result.tokens
            parts = [result.tokens, result.logprobs, result.top_ids, result.top_logprobs]
            copies = [None if t is None else t.to("cpu", non_blocking=True) for t in parts]
            if self.grammar.rows:
                self.grammar.sampled(sample_rows, copies[0])
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

    def prepare_batch(self, plan: StepPlan) -> ForwardBatch:
        """Accept the plan and build its eager batch, backend metadata included, without running the model
        (for tests and tools that call the model's parts themselves)."""
        self._accept(plan)
        return self._build_batch(plan)[0]

    def token_logits(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of every new token of the step (eager; for tests and prompt scoring)."""
        with torch.inference_mode():
            batch = self.prepare_batch(plan)
            hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
            return self.model.compute_logits(hidden).float()

    def _accept(self, plan: StepPlan) -> None:
        """Check the plan, then apply its row changes (released and added requests)."""
        _check_plan(plan, self.cfg)
        self.kv_pool.check_plan(plan)
        self._update_rows(plan)

    def _forward_plan(self, plan: StepPlan) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        self._accept(plan)
        sample_rows = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        if not plan.rows:
            return torch.empty(0, self.vocab_size, device=self.device), [], self.tables.last_token[:0]
        if self.graphs is not None and self.graphs.fits(plan):
            logits, rows_t = self.graphs.run(plan)
            return logits, sample_rows, rows_t
        batch, last_idx, sample_rows_t = self._build_batch(plan)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
        return self.model.compute_logits(hidden[last_idx]), sample_rows, sample_rows_t

    def _update_rows(self, plan: StepPlan) -> None:
        for row in plan.released:
            self.sampler.release(row)
            self.grammar.release(row)
            self.kv_pool.release_row(row)
        for start in plan.added:
            if start.prefix_slots and not self.model.abilities.prefix_cache:
                raise ValueError(
                    f"row {start.row} starts with a cached prefix, which {type(self.model).__name__} "
                    "cannot reuse (serve it with the radix cache off)"
                )
            if start.prefix_slots:
                slots = torch.tensor(start.prefix_slots, dtype=torch.int64)
                self.tables.req_to_token[start.row, : len(start.prefix_slots)] = slots.to(self.device)
            self.sampler.register(start)
            if start.params.grammar is not None:
                self.grammar.add(start.row, start.params.grammar, start.output_ids)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        ext = torch.tensor(plan.extend_lens, dtype=torch.int64)
        rows = torch.tensor(plan.rows, dtype=torch.int64)
        use_last = torch.repeat_interleave(torch.tensor(plan.use_last, dtype=torch.bool), ext)
        positions, starts = token_positions(plan.prefix_lens, plan.extend_lens)
        token_rows = torch.repeat_interleave(rows, ext)
        ids = torch.zeros(len(positions), dtype=torch.int64)
        ids[~use_last] = torch.tensor(plan.input_ids, dtype=torch.int64)
        sample = torch.tensor(plan.sample, dtype=torch.bool)
        last_idx = (starts + ext - 1)[sample]
        # aligned columns: with them packed end to end, an odd token count shifted the positions the
        # RoPE kernel reads and compiled a new variant mid-run
        cols = [ids, positions, plan.out_loc, token_rows, use_last, last_idx, rows[sample], rows]
        ids_d, pos_d, loc_d, token_rows_d, use_last_d, last_idx_d, sample_rows_d, rows_d = columns_to_device(
            cols, self.device
        )
        host = (list(plan.rows), list(plan.prefix_lens), list(plan.extend_lens), list(plan.replay))
        batch = make_batch(
            self.tables, self.kv_pool, ids_d, pos_d, loc_d, token_rows_d, use_last_d != 0, rows_d, host
        )
        self.attn.prepare(batch)
        return batch, last_idx_d, sample_rows_d


def _page_size(asked: int, multiple: int) -> int:
    """The asked page size, raised to a multiple of the pool's page multiple (V4: pages hold whole
    compression windows); the scheduler learns the result from the capabilities message."""
    if asked % multiple == 0:
        return asked
    page_size = math.lcm(asked, multiple)
    log.warning(
        "page_size_raised",
        requested=asked,
        page_size=page_size,
        reason=f"the model's paged state needs pages of a multiple of {multiple} tokens",
    )
    return page_size


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
