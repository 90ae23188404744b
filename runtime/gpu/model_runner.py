"""The tensor side of one worker: weights, KV pool, request tables, forward and sampling of a step.

`launch(plan)` is the whole contract with the scheduler (see `StepPlan`), and `capabilities()` is what
the scheduler learns about the model and its pool at start-up. Per step the host builds all index
tensors in one packed int64 tensor and moves it with one copy; rows that feed back their last sampled
token (`use_last`) read it from the device table `last_token`, so a plan can be sent before the previous
step's tokens reach the host.

Decode steps (every row one new token) run as CUDA graphs on CUDA (`cuda_graph.GraphRunner`), unless
`cuda_graph` is off; the step's tokens come back through one device-to-host copy."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from runtime.config import RunnerConfig
from runtime.engram.layer import slot_bytes
from runtime.engram.runtime import make_engram_runtime
from runtime.gpu import compile_watch, distributed, loader, presets
from runtime.gpu.attention import default_backend
from runtime.gpu.cuda_graph import GraphRunner, StepGraph
from runtime.gpu.forward_batch import ForwardBatch, StepTables, columns_to_device, make_batch
from runtime.gpu.grammar import GrammarTable
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.layers import expert_parallel
from runtime.gpu.layers.expert_parallel import ExpertParallelMoE, ExpertPlacement
from runtime.gpu.layers.moe import balance_routing
from runtime.gpu.model_builder import build_model, resolve_dtype, resolve_kv_dtype
from runtime.gpu.pending import Copies, PendingStep
from runtime.gpu.sampler import Sampler
from runtime.gpu.step_inputs import Sampled, check_plan, eager_inputs, settle
from runtime.gpu.warm_up import warm_up
from runtime.mailbox.messages import EngramCounters, StepOutput, StepPlan, WorkerCapabilities
from runtime.model_info import tokenizer_dir
from runtime.speculative.drafters import make_drafter
from runtime.speculative.worker import Emitted, Speculation, VerifyRows

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
        if cfg.world_size > 1:  # before the model is built: its parallel layers read their rank's place
            distributed.init(
                cfg.rank, cfg.world_size, cfg.tp_size, cfg.dist_init_addr, self.device, cfg.ep_size
            )
        if cfg.moe_a2a_backend not in ("auto", "all_to_all"):
            raise ValueError(f"--moe-a2a-backend {cfg.moe_a2a_backend!r}: auto | all_to_all")
        placement = ExpertPlacement.load(cfg.expert_placement) if cfg.expert_placement else None
        expert_parallel.use(
            placement,
            cfg.ep_num_redundant_experts,
            always=cfg.moe_a2a_backend == "all_to_all",
            count_load=cfg.expert_load_out is not None,
        )
        path = Path(presets.resolve(cfg.model_path))
        self.config = loader.load_config(path, cfg.hf_overrides)
        self.vocab_size: int = self.config.vocab_size
        self.eos_token_ids: list[int] = _eos_ids(path, self.config)
        self.model = build_model(cfg, self.config, path, self.device, self.dtype)
        if cfg.balanced_routing:  # before any graph is captured (layers/moe.py)
            balance_routing(self.model, cfg.seed)
        self.engram = make_engram_runtime(cfg, path, self.device, self.dtype)  # None without Engram
        self._exchanges: list[ExpertParallelMoE] | None = None  # the MoE layers' EP exchanges

        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and not self.model.abilities.fp8_kv_cache:
            raise ValueError(
                f"--kv-cache-dtype {cfg.kv_cache_dtype} is supported for Llama-family and DeepSeek-V2/V3"
                f" models, not {type(self.model).__name__}"
            )
        rows = cfg.max_reqs + 1  # row 0 is padding
        slots = distributed.world_min(self._pool_slots(rows), self.device)  # one size on every rank
        spec = KVPoolSpec(slots, rows, self.kv_dtype, self.device, cfg.max_model_len)
        self.kv_pool = self.model.make_kv_pool(spec)
        self.page_size = _page_size(cfg.page_size, self.kv_pool.page_multiple)
        self.attn = self.model.make_attention_backend(
            cfg.attention_backend or default_backend(self.device), self.page_size
        )
        # Models with per-request state outside the paged pool (V4's window ring and compressor tails)
        # rebuild it on a prefix hit by replaying this many tokens before the hit (StepPlan.replay).
        self.prefix_replay = self.kv_pool.replay_tokens(cfg.swa_replay_tokens, cfg.swa_replay_exact)
        self.spec: Speculation | None = None
        max_draft = cfg.speculative_num_draft_tokens if cfg.speculative_algorithm else 0
        self.tables = StepTables.allocate(rows, cfg.max_model_len, self.device, max_draft)
        if cfg.speculative_algorithm:
            if not self.model.abilities.truncate_kv:
                raise ValueError(
                    f"--speculative-algorithm needs a KV pool that drops rejected drafts; "
                    f"{type(self.model).__name__}'s per-request state cannot yet"
                )
            block = self.kv_pool.max_verify_block
            if block is not None and max_draft + 1 > block:
                raise ValueError(
                    f"--speculative-num-draft-tokens {max_draft}: {type(self.model).__name__}'s per-request state "
                    f"rolls back blocks of at most {block} tokens (at most {block - 1} drafts)"
                )
            drafter = make_drafter(
                cfg, self.tables, self.kv_pool.num_slots, self.vocab_size, self.dtype, self.model
            )
            self.spec = Speculation(drafter, self.tables)
        self.sampler = Sampler(cfg.max_reqs, self.vocab_size, self.device, cfg.seed)
        self.grammar = GrammarTable(self._grammar_compiler, self.vocab_size, self.device)
        self._t_ref: torch.cuda.Event | None = None
        self.graphs: GraphRunner | None = None
        self._eager_step = False  # the DP ranks agreed on an eager step (set_step_shape)
        if self.engram is not None and cfg.speculative_algorithm:
            raise ValueError("speculative decoding is not supported with Engram (drafts live on the device)")
        # Engram read on the device runs in the decode graphs; lookups through the host (split, the
        # mailbox) run eager
        graphs_ok = self.attn.supports_cuda_graph and (
            self.engram is None or self.engram.on_device is not None
        )
        if cfg.cuda_graph and self.device.type == "cuda" and graphs_ok:
            self.graphs = self.make_graphs(min(cfg.cuda_graph_max_bs or cfg.max_reqs, cfg.max_reqs))
            if self.spec is not None:
                self.spec.capture_observe(self.graphs.buckets)
        if self.device.type == "cuda" and self.attn.wants_warm_up:
            warm_up(cfg, self.kv_pool.num_slots, self.forward_logits)
            torch.cuda.synchronize(self.device)
        if self.device.type == "cuda":
            compile_watch.mark_serving()

    def _pool_slots(self, rows: int) -> int:
        """The KV pool's token slots: what `mem_fraction_static` of the GPU's memory leaves after the
        weights (what is already allocated) and the per-request state, or `num_kv_slots` when that is
        less; the rest of the memory is for activations and CUDA graphs. A fixed `num_kv_slots` elsewhere."""
        # Engram layers keep a convolution input per KV slot (runtime/engram/layer.py)
        cfg, per_token = (
            self.cfg,
            self.model.kv_bytes_per_token(self.kv_dtype) + slot_bytes(self.model, self.dtype),
        )
        if self.device.type != "cuda":
            if cfg.num_kv_slots is None:
                raise ValueError("the KV pool is sized from memory on CUDA only: give num_kv_slots")
            return cfg.num_kv_slots
        free, total = torch.cuda.mem_get_info(self.device)
        budget = (
            free - total * (1 - cfg.mem_fraction_static) - rows * self.model.kv_bytes_per_row(self.kv_dtype)
        )
        slots = int(budget // per_token)
        if cfg.num_kv_slots is not None and cfg.num_kv_slots <= slots:
            return cfg.num_kv_slots
        if slots < 2 * cfg.max_model_len:
            raise ValueError(
                f"the KV pool would hold {max(slots, 0)} tokens, under two requests of max_model_len "
                f"{cfg.max_model_len}: raise --mem-fraction-static ({cfg.mem_fraction_static}) or lower "
                "--max-model-len"
            )
        log.info(
            "kv_pool", tokens=slots, gib=round(slots * per_token / 2**30, 2), dtype=str(self.kv_dtype),
            mem_fraction_static=cfg.mem_fraction_static,
        )  # fmt: skip
        return slots

    def make_graphs(self, max_bs: int, capture: bool = True) -> GraphRunner:
        """Decode graphs over this runner's model, backend, pool and tables, and verify graphs when it
        speculates (`capture=False`: the padded static-buffer path run eagerly, as the CPU tests check it)."""
        spec = self.spec
        q_len = spec.max_draft + 1 if spec is not None else 1
        # DP ranks in lockstep: each padded forward sizes the MoE exchanges by its bucket (cuda_graph.py)
        lockstep = self.cfg.world_size > 1 and self.cfg.ep_size > 1
        return GraphRunner(
            self.model, self.attn, self.kv_pool, self.tables,
            max_bs=max_bs, max_model_len=self.cfg.max_model_len, vocab_size=self.vocab_size, capture=capture,
            verify_q_len=q_len, engram=self.engram, lockstep=lockstep,
            hidden_sink=spec.capture if spec is not None and spec.follows_target else None,
            taps=spec.drafter.taps if spec is not None else (),
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
            max_draft=self.spec.max_draft if self.spec is not None else 0,
            verify_ahead=self.verify_ahead,
            engram=self.engram is not None and self.engram.wants_addresses,
            compute_bound_tokens=_compute_bound_tokens(self.device),
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
            s = self._forward_plan(plan)
            if not s.rows:
                return PendingStep(plan.step, [], None, None, start, self._timing_event(), t0, self._t_ref)
            spec, verify = self.spec, s.verify
            if verify is None:
                mask = self.grammar.mask(s.rows) if self.grammar.rows else None  # waits for step N's tokens
                result = self.sampler.sample(s.logits, s.rows, s.rows_t, mask)
                emitted = Emitted(result.tokens[:, None], None, None)
            else:  # a constrained row never has drafts: its one position takes its mask
                mask = self.grammar.mask(s.rows) if self.grammar.rows else None
                mask = None if mask is None else mask.at(verify.block_start)
                block = spec.block(s.rows, s.rows_t, verify)
                result = self.sampler.sample(s.logits, s.pos_rows, s.pos_rows_t, mask, block=block)
                emitted = spec.accept(self.sampler, result, s.rows_t, verify)
                if s.saved is not None:  # per-row state (V4's ring and tails) drops the rejected drafts
                    self.kv_pool.restore_rejected(s.saved, emitted.counts[s.saved_rows])
            last = emitted.tokens[:, 0] if emitted.counts is None else _last(emitted)
            self.tables.last_token[s.rows_t] = last
            drafts, draft = None, 0.0
            if spec is not None:
                ev = self._timing_event(), None
                t = time.perf_counter()
                drafts = spec.propose(s.rows_t, emitted, plan.propose)
                draft = (ev[0], self._timing_event()) if ev[0] is not None else time.perf_counter() - t
            copies = Copies.start(
                tokens=emitted.tokens,
                counts=emitted.counts,
                logprobs=_per_emitted(result.logprobs, emitted),
                top_ids=_per_emitted(result.top_ids, emitted),
                top_logprobs=_per_emitted(result.top_logprobs, emitted),
                draft_counts=None if drafts is None else drafts.counts,
                draft_conf=None if drafts is None else drafts.confidence,
            )
            if self.grammar.rows:
                self.grammar.sampled(s.rows, copies.tokens[:, 0])
            if self.engram is not None:  # the next step's decode rows complete their addresses with these
                self.engram.sampled(s.rows, copies.tokens)
        return PendingStep(
            plan.step, s.rows, copies, _per_row(result.top_counts, verify), start, self._timing_event(), t0,
            self._t_ref,
            on_counts=Speculation.advance(self.sampler, s.rows, verify) if verify is not None else None,
            draft=draft,
        )  # fmt: skip

    def graph_shape(self, plan: StepPlan | None) -> tuple[StepGraph, int]:
        """The graph `plan` would replay and its rows, for the DP ranks to agree on one (lockstep.py)."""
        if plan is None or not plan.rows:
            return StepGraph.IDLE, 0
        path = self._graph_path(plan)
        kind = {None: StepGraph.EAGER, "decode": StepGraph.DECODE, "verify": StepGraph.VERIFY}[path]
        return kind, len(plan.rows)

    def set_step_shape(self, most_tokens: int, graph: StepGraph, rows: int) -> None:
        """What the DP ranks agreed for the next step: every rank replays `graph` (DECODE or VERIFY) at
        the bucket of `rows` rows, the largest batch, and an idle rank sizes its exchanges alike; or
        (EAGER) every rank runs eagerly, its exchanges sized by the most tokens any rank has."""
        self._eager_step = graph == StepGraph.EAGER
        if self.graphs is not None:
            self.graphs.agreed_bs = 0  # `bucket` below: the smallest that holds `rows`
        if self.graphs is None or self._eager_step:
            self.set_step_tokens(most_tokens)
            return
        self.graphs.agreed_bs = self.graphs.bucket(rows)
        # an idle rank's eager step exchanges as the replaying ranks' graphs do: fixed blocks
        self.set_step_tokens(self.graphs.tokens(graph, rows), graphed=True)

    def set_step_tokens(self, n: int, graphed: bool = False) -> None:
        """The next step's most tokens on any DP rank (they agreed on it): MoE exchanges size by it;
        `graphed`: the ranks replay graphs, whose exchanges take fixed blocks whatever the size."""
        if self._exchanges is None:
            self._exchanges = [m for m in self.model.modules() if isinstance(m, ExpertParallelMoE)]
        for m in self._exchanges:
            m.step_tokens, m.graphed = n, graphed

    def engram_counters(self) -> EngramCounters | None:
        return self.engram.counters() if self.engram is not None else None

    def save_expert_load(self) -> None:
        """With `expert_load_out`: this rank's measured expert load (tokens routed to each logical
        expert, summed over MoE layers) as `expert_load.rank{r}.json` there, for `rebalance`."""
        if not self.cfg.expert_load_out:
            return
        self.set_step_tokens(0)  # finds the exchanges
        loads = [m.load for m in self._exchanges or [] if m.load is not None]
        if not loads:
            return
        total = torch.stack(loads).sum(0).tolist()
        out = Path(self.cfg.expert_load_out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"expert_load.rank{self.cfg.rank}.json").write_text(json.dumps(total))

    def idle_step(self) -> None:
        """Join one step's collectives without tokens (a DP rank idle while others run a step)."""
        with torch.inference_mode():
            self.model.idle_forward()

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
        """float32 logits of the sampled positions, without sampling (for tests and scoring)."""
        with torch.inference_mode():
            # a copy: a graph's logits buffer is reused next step
            return self._forward_plan(plan).logits.to(torch.float32, copy=True)

    def prepare_batch(self, plan: StepPlan) -> ForwardBatch:
        """Accept the plan and build its eager batch, backend metadata included, without running the model
        (for tests and tools that call the model's parts themselves)."""
        self._accept(plan)
        return self._build_batch(settle(plan, self.tables))[0]

    def token_logits(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of every new token of the step (eager; for tests and prompt scoring)."""
        with torch.inference_mode():
            batch = self.prepare_batch(plan)
            hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
            return self.model.compute_logits(hidden).float()

    def _accept(self, plan: StepPlan) -> None:
        """Check the plan, then apply its row changes (released and added requests)."""
        check_plan(
            plan,
            self.cfg.max_reqs,
            self.cfg.max_model_len,
            self.spec.max_draft if self.spec is not None else 0,
        )
        self.kv_pool.check_plan(plan)
        self._update_rows(plan)
        if self.engram is not None:
            self.engram.begin(plan)

    def _forward_plan(self, plan: StepPlan) -> Sampled:
        self._accept(plan)
        if not plan.rows:
            empty = self.tables.last_token[:0]
            return Sampled(torch.empty(0, self.vocab_size, device=self.device), [], empty)
        rows = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        graph = None if self._eager_step else self._graph_path(plan)
        if graph is None:  # the eager path plans attention from host lengths: rows planned ahead settle
            plan = settle(plan, self.tables)
        if self.spec is not None and plan.draft_lens:
            self.spec.prepare(plan)
        if graph == "verify":
            saved, saved_rows = self._save_blocks(plan)
            v = self.graphs.run_verify(plan)
            ks = list(plan.draft_lens)
            pos_rows = [r for r, k in zip(rows, ks, strict=True) for _ in range(k + 1)]
            verify = VerifyRows(ks, v.block_start, v.draft_lens, v.offsets, v.owner)
            return Sampled(v.logits, rows, v.rows, pos_rows, v.pos_rows, verify, saved, saved_rows)
        if graph == "decode":
            logits, rows_t = self.graphs.run(plan)
            return Sampled(logits, rows, rows_t)
        batch, sampled = self._build_batch(plan)
        if sampled.verify is not None:
            sampled.saved, sampled.saved_rows = self._save_blocks(plan)
        if self.spec is not None and self.spec.drafter.taps:
            batch.taps = dict.fromkeys(self.spec.drafter.taps)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
        if self.spec is not None:
            self.spec.capture(batch, hidden)
        sampled.logits = self.model.compute_logits(hidden[sampled.logits])
        return sampled

    def _graph_path(self, plan: StepPlan) -> str | None:
        """The graph the step replays ("verify" or "decode"), None when it runs eagerly. (A DP rank also
        runs eagerly when the ranks agreed so: `set_step_shape`.)"""
        if self.graphs is None:
            return None
        if any(plan.draft_lens):
            return "verify" if self.graphs.fits_verify(plan) else None
        return "decode" if self.graphs.fits(plan) else None

    @property
    def verify_ahead(self) -> bool:
        """Whether the scheduler may plan a row before its previous verify step's counts reach the host
        (`StepPlan.assume_accepted`): every drafter drafts on the device right after a step, so wherever
        the verify step moves such rows back itself. Verify graphs do it on the device; eager steps
        settle the rows first (`step_inputs.settle`): a free host read on the CPU, a wait for the
        previous step on CUDA, which would undo the overlap."""
        if self.spec is None:
            return False
        return self.device.type == "cpu" or (self.graphs is not None and self.graphs.q_len > 1)

    def _save_blocks(self, plan: StepPlan) -> tuple[object | None, torch.Tensor | None]:
        """Before a verify step: what the verify rows' blocks overwrite of the pool's per-row state, to
        restore the rejected positions once the counts are known, and those rows' index among the sampled
        rows (None, None for paged pools). A row planned ahead (a graph step's) starts its block where
        the device moves it back to."""
        if self.kv_pool.max_verify_block is None:
            return None, None
        among = itertools.accumulate([0, *plan.sample[:-1]])  # sampled rows before each row
        ahead = plan.assume_accepted or [False] * len(plan.rows)
        cols = zip(plan.rows, plan.prefix_lens, plan.draft_lens, among, ahead, strict=True)
        verify = [(r, p, i, a) for r, p, k, i, a in cols if k]
        rows, first, index, behind = columns_to_device(
            [list(c) for c in zip(*verify, strict=True)], self.device
        )
        first = first - self.tables.behind(rows, behind)
        return self.kv_pool.save_blocks(rows, first, self.spec.max_draft + 1), index

    def release_rows(self, rows: list[int]) -> None:
        for row in rows:
            self.sampler.release(row)
            self.grammar.release(row)
            self.kv_pool.release_row(row)
            if self.spec is not None:
                self.spec.release(row)

    # ------------------------------------------------------------------ disaggregation (runtime/disaggregation)

    def export_request(self, row: int, end: int, start: int = 0) -> dict[str, torch.Tensor]:
        """The KV (and per-request state) of the request in `row`, positions start..end-1, as device
        copies enqueued behind the launched steps."""
        with torch.inference_mode():
            return self.kv_pool.export_request(row, self.tables.req_to_token[row, start:end].clone())

    def import_request(self, row: int, slots: list[int], kv: dict[str, torch.Tensor]) -> None:
        """Write a request exported by another server's runner at `slots` (its positions) and `row`."""
        with torch.inference_mode():
            self.kv_pool.import_request(row, torch.tensor(slots, dtype=torch.int64, device=self.device), kv)

    def _update_rows(self, plan: StepPlan) -> None:
        self.release_rows(plan.released)
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
            if self.spec is not None:
                self.spec.register(start)
            if start.params.grammar is not None:
                self.grammar.add(start.row, start.params.grammar, start.output_ids)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, Sampled]:
        """The eager batch, backend metadata included, and what the step samples (`step_inputs.py`)."""
        cols, host, sampled = eager_inputs(plan, self.device)
        batch = make_batch(self.tables, self.kv_pool, *cols, host)
        if self.engram is not None:
            batch.engram = self.engram.start(plan, batch)
        self.attn.prepare(batch)
        return batch, sampled


def _per_row(per_position: list[int] | None, verify: VerifyRows | None) -> list[int] | None:
    """A per-sampled-position host list taken at each row's first position (a row's block shares it)."""
    if per_position is None or verify is None:
        return per_position
    firsts = itertools.accumulate([0] + [k + 1 for k in verify.draft_lens[:-1]])
    return [per_position[i] for i in firsts]


def _last(emitted: Emitted) -> torch.Tensor:
    """Each row's last emitted token."""
    return emitted.tokens.gather(1, (emitted.counts - 1)[:, None]).squeeze(1)


def _per_emitted(t: torch.Tensor | None, emitted: Emitted) -> torch.Tensor | None:
    """A per-sampled-position tensor ([P] or [P, k]) rearranged per row and emitted token ([B, W, ...])."""
    if t is None:
        return None
    if emitted.index is None:
        return t[:, None]
    return t[emitted.index]


def _compute_bound_tokens(device: torch.device) -> int:
    """Step tokens at which a forward stops being bound by reading the weights: on an H200 a bf16
    weight's 2 flops per token reach the copy bandwidth's ridge (765 TFLOP/s over 4.25 TB/s, 180 flops
    per byte) near 200 tokens, and a Llama-8B verify step of 256 tokens took 1.7x a 64-token decode step
    (docs/PERF.md); one CPU thread's ridge is near 10 flops per byte, a few tokens of float32."""
    if device.type == "cuda":
        return 256
    return 4 * torch.get_num_threads()


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
