"""Configuration in layers, each frozen and resolved once:

    ServerConfig     what the user asked for: built from the CLI in one place (runtime/cli.py) and shipped
                     to child processes as msgpack
    RunnerConfig     the tensor side of one rank (`RunnerConfig.resolve`: defaults by device settled)
    SchedulerConfig  the scheduler of one DP rank: the server's choices plus what its worker reported at
                     start-up (`WorkerCapabilities`: the pool's size and page layout, prefix-cache ability)

No component rewrites another's config after start-up: what the worker decides (a page size raised to the
model's page multiple, the pool size) reaches the scheduler in the capabilities message."""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.engram.config import EngramOptions
from runtime.mailbox.messages import WorkerCapabilities

# admission's first reserve: this share of each running request's remaining max_tokens (SGLang's
# SGLANG_INIT_NEW_TOKEN_RATIO), scaled by --schedule-conservativeness; it decays while nothing retracts
INIT_NEW_TOKEN_RATIO = 0.7


class ServerConfig(msgspec.Struct, kw_only=True, frozen=True):
    # model
    model: str | None = None  # HF directory; None = the embedded default (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model directory
    load_format: str = "auto"  # "auto" | "dummy" (random weights; `model` may then be a preset name)
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on cpu, bfloat16 on cuda
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8_e4m3"
    # DeepSeek-V2/V3 FP8 block weights: "auto" (kept for an FP8 checkpoint on CUDA) | "none" | "fp8"
    quantization: str = "auto"
    seed: int = 0
    # merged into the model's config.json before it is read (vLLM's --hf-overrides), e.g.
    # {"num_hidden_layers": 8} to fit a cut-down DeepSeek-V4-Flash preset on one GPU
    hf_overrides: dict[str, Any] | None = None
    # limits
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_running_requests: int | None = None  # default by device (`resolved_max_running_requests`)
    # KV pool size in token slots: on CUDA a cap on what memory allows (`mem_fraction_static`); on the
    # CPU the size (default 32768)
    max_total_tokens: int | None = None
    # CUDA: the share of the GPU's memory for weights and the KV pool (SGLang's name and meaning); the
    # rest is left for activations and CUDA graphs. Default by the GPU's memory (`resolved_...`).
    mem_fraction_static: float | None = None
    page_size: int = 1
    chunked_prefill_size: int | None = None  # default: by device memory (`resolved_chunked_prefill_size`)
    max_queued_requests: int = 4096
    # scheduling
    schedule_policy: str = "fcfs"
    # scales the share of each running request's remaining max_tokens that admission keeps free for it
    # (SGLang's name: 1.0 reserves 70% at first); lower admits more and retracts more
    schedule_conservativeness: float = 1.0
    disable_overlap: bool = False
    disable_radix_cache: bool = False
    # Engram tables (runtime/engram, docs/engram.md): where they live, and the prefetch's switches
    engram_placement: str = "host"  # host | device | split
    engram_shards: int = 2  # host: EngramShardActor processes; split: ranks of the engram group
    disable_engram_prefetch: bool = False
    engram_lookup_delay_ms: float = 0.0  # injected per-lookup latency (benchmarks)
    # prefix hits on models with sliding-window state outside the pages (DeepSeek-V4): tokens before the
    # hit replayed to rebuild it (None: the model's sliding window), or replay from 0 (exact, for checks)
    swa_replay_tokens: int | None = None
    swa_replay_exact: bool = False
    # speculative decoding (runtime/speculative): a drafter proposes up to `speculative_num_draft_tokens`
    # tokens per request and step, verified together by the target
    speculative_algorithm: str | None = None  # None | "ngram" | "draft-model" | "mtp" | "dspark"
    speculative_num_draft_tokens: int = 3
    speculative_ngram_min_match_window_size: int = 1  # n-gram drafter: the n-gram sizes it looks up
    speculative_ngram_max_match_window_size: int = 4
    speculative_draft_model_path: str | None = None  # draft-model: a checkpoint sharing the tokenizer
    # adaptive: each request verifies what its acceptance and the load make worth it (policy.py);
    # fixed: every draft the drafter holds, up to the count above
    speculative_draft_policy: str = "adaptive"
    # prefill/decode disaggregation (runtime/disaggregation, docs/disaggregation.md)
    disaggregation_mode: str | None = None  # None | "prefill" | "decode"
    disaggregation_transfer_backend: str = "tcp"  # tcp | shm | nccl | nixl | mooncake
    disaggregation_bootstrap_port: int = 8998  # decode: where prefill servers send KV (on `host`)
    disaggregation_transfer_timeout: float = 60.0
    # fast path
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # largest decode batch captured; default max_running_requests
    attention_backend: str | None = None  # default: triton on cuda, torch on cpu
    cpu_threads: int | None = None  # torch threads of a CPU engine (None: torch's default, one per core)
    # serving
    host: str = "127.0.0.1"
    port: int = 30000
    placement: str = "multiprocess"  # "multiprocess" (frontend + engine process) | "single"
    # many ranks (docs/parallelism.md; SGLang's names): one engine process per rank
    tp_size: int = 1  # ranks of the engine; dense layers split over each attention group's ranks
    dp_size: int = 1  # with enable_dp_attention: data-parallel attention groups, each its own scheduler
    enable_dp_attention: bool = False
    ep_size: int = 1  # MoE experts split over this many ranks (1 or the world size)
    ep_num_redundant_experts: int = 0  # extra expert slots holding copies of hot experts
    expert_placement: str | None = None  # a JSON ExpertPlacement file (e.g. from `rebalance`)
    # "auto": MoE tokens travel by all-to-all when experts split over ranks; "all_to_all": always, even on
    # one rank (to measure the EP path's cost against the plain fused MoE)
    moe_a2a_backend: str = "auto"
    # at shutdown each rank writes its measured expert load there (`expert_parallel.rebalance` input)
    expert_load_out: str | None = None
    nnodes: int = 1  # machines; each runs `conduit serve` with its --node-rank, node 0 the HTTP frontend
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port where rank 0 gathers the world (default: loopback)
    # what the OpenAI surface adds to the model (docs/serving.md)
    generation_config: str = "auto"  # sampling defaults: "auto" (the model's) | "vllm" (none) | a path
    override_generation_config: dict[str, Any] | None = None  # merged over them (vLLM's flag)
    chat_template: str | None = (
        None  # a file, a built-in name (deepseek-v3, deepseek-r1, deepseek-v4), inline
    )
    tool_call_parser: str | None = None  # None: by model family (runtime/parsers/tool_calls)
    reasoning_parser: str | None = None  # "deepseek-r1" | "deepseek-v3"; None: no reasoning_content
    api_key: str | None = None  # required as a bearer token on every route but /health and the page
    allowed_origins: list[str] = []  # CORS: origins whose browsers may call the API ("*": any)
    max_body_bytes: int | None = None  # default: fits the context length (`resolved_max_body_bytes`)
    max_requests_per_websocket: int = 256
    shutdown_timeout: float = 10.0  # SIGTERM/SIGINT: seconds in-flight requests get to finish
    max_engine_restarts: int = 3  # engine process deaths restarted within 10 minutes

    def world_size(self) -> int:
        """Engine ranks: `tp_size` (SGLang: --tp 4 --dp 4 --enable-dp-attention is four ranks), or
        `dp_size` / `ep_size` when only those were given."""
        dp = self.dp_size if self.enable_dp_attention else 1
        return max(self.tp_size, dp, self.ep_size)

    def attention_tp_size(self) -> int:
        """Ranks one DP group's dense layers split over (the world, without DP attention)."""
        return self.world_size() // (self.dp_size if self.enable_dp_attention else 1)

    def check_parallelism(self) -> None:
        """Raise ValueError for a combination of parallelism flags that does not make a world."""
        world, dp = self.world_size(), self.dp_size if self.enable_dp_attention else 1
        for name, n in (
            ("--tp-size", self.tp_size),
            ("--dp-size", self.dp_size),
            ("--ep-size", self.ep_size),
        ):
            if n < 1 or world % n:
                raise ValueError(f"{name} {n} must be at least 1 and divide the world size {world}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError("--dp-size needs --enable-dp-attention (replicas: run several servers)")
        if self.ep_size not in (1, world):
            raise ValueError(f"--ep-size {self.ep_size} must be 1 or the world size {world}")
        if (dp > 1 or self.ep_size > 1) and not (dp == self.ep_size == world):
            raise ValueError(
                "data-parallel attention with expert parallelism runs over every rank: give --dp-size, "
                f"--ep-size (and --tp-size) equal, with --enable-dp-attention (world size {world})"
            )
        if world % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"{world} ranks do not split over --nnodes {self.nnodes} (node {self.node_rank})"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")

    def resolved_max_body_bytes(self, max_model_len: int) -> int:
        """The request body limit: room for a full context written out as JSON (64 bytes per token
        covers token-id lists and escaped non-ASCII text), at least 1 MiB."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(1 << 20, 64 * max_model_len)

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")

    def _gpu_gib(self) -> float | None:
        """The GPU's memory in GiB; None on the CPU."""
        if not self.device.startswith("cuda"):
            return None
        import torch

        return torch.cuda.get_device_properties(torch.device(self.device)).total_memory / 2**30

    def resolved_chunked_prefill_size(self) -> int:
        """The step's token budget: as given, else by the GPU's memory (2048 under 35 GB, 8192 under
        120 GB as on an H100, 16384 above: an H200's 16K-token steps prefill faster than 8K ones at no
        cost to decode), and 2048 on the CPU."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        gib = self._gpu_gib()
        if gib is None:
            return 2048
        return 2048 if gib < 35 else 8192 if gib < 120 else 16384

    def resolved_max_running_requests(self) -> int:
        """Requests decoded together: as given, else 256 on GPUs of 60 GB and more (a decode step of 256
        rows still reads mostly weights there), 128 on smaller ones and on the CPU."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        gib = self._gpu_gib()
        return 256 if gib is not None and gib >= 60 else 128

    def resolved_mem_fraction_static(self) -> float:
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        gib = self._gpu_gib() or 0.0
        return 0.9 if gib >= 120 else 0.88 if gib >= 60 else 0.85 if gib >= 35 else 0.8

    def kv_slot_cap(self) -> int | None:
        """The KV pool's size in token slots when it is fixed: `max_total_tokens`, or 32768 on the CPU;
        None on CUDA without a cap (the runner sizes the pool from the memory left after the weights)."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return None if self.device.startswith("cuda") else 32768


class RunnerConfig(msgspec.Struct, frozen=True):
    """One rank's model runner."""

    model_path: str
    device: str = "cpu"
    dtype: str | None = None  # default float32 on cpu, bfloat16 on cuda
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype | "fp8_e4m3" (Llama and DeepSeek-V2/V3 pools)
    load_format: str = "auto"  # "auto" | "dummy"
    balanced_routing: bool = False  # MoE routers send tokens evenly (benchmarks on dummy weights, moe.py)
    # FP8 block-scaled weights (DeepSeek-V2/V3/V4, `quant.fp8.keep_fp8`; V4 also its FP4 experts): "auto"
    # keeps an FP8 checkpoint's on CUDA, "none" dequantizes, "fp8" keeps them (quantizing float or dummy
    # weights at load)
    quantization: str = "auto"
    # including slot 0 (padding); None: as many as `mem_fraction_static` of the GPU's memory holds after
    # the weights (CUDA only)
    num_kv_slots: int | None = 16384
    mem_fraction_static: float = 0.9
    max_reqs: int = 256  # rows of req_to_token; row 0 is padding, rows 1..max_reqs usable
    max_model_len: int = 8192
    page_size: int = 1  # as asked: the runner raises it to a multiple of the pool's page multiple
    seed: int = 0
    attention_backend: str | None = None  # None: "triton" on CUDA when Triton imports, else "torch"
    cuda_graph: bool = True  # decode steps as CUDA graphs (CUDA only; needs a graph-safe backend)
    cuda_graph_max_bs: int | None = None  # largest captured batch; None: max_reqs
    # torch intra-op threads for CPU runs (process-wide); None leaves torch's default. On a small, busy
    # machine 1 thread is far faster: with 2 threads on 2 shared cores every op waits on a barrier.
    cpu_threads: int | None = None
    hf_overrides: dict[str, Any] | None = None  # merged into config.json (ServerConfig.hf_overrides)
    # Prefix-cache hits on models with per-request state outside the pages (DeepSeek-V4): tokens before
    # the hit to replay (None: the model's sliding window), or replay from position 0 (exact, slower).
    swa_replay_tokens: int | None = None
    swa_replay_exact: bool = False
    # the scheduler's prefill token budget per step (the chunked-prefill size): the warm-up runs one
    # step that large, so the first real one does not pay for its allocations and kernel variants
    max_prefill_tokens: int | None = None
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1  # ranks this rank's dense layers split over (its attention group)
    ep_size: int = 1
    ep_num_redundant_experts: int = 0
    expert_placement: str | None = None  # path of a JSON ExpertPlacement
    moe_a2a_backend: str = "auto"  # "auto" | "all_to_all" (ServerConfig)
    expert_load_out: str | None = None
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous (world_size > 1)
    speculative_algorithm: str | None = None  # ServerConfig's speculative settings
    speculative_num_draft_tokens: int = 3
    speculative_ngram_sizes: tuple[int, int] = (1, 4)
    speculative_draft_model_path: str | None = None
    tokenizer: str | None = None  # --tokenizer: the vocabulary structured output compiles against
    engram: EngramOptions | None = None  # None: defaults (runtime/engram/runtime.py)

    @classmethod
    def resolve(
        cls,
        cfg: ServerConfig,
        model_path: str,
        max_model_len: int,
        rank: int = 0,
        world_size: int = 1,
        dist_init_addr: str | None = None,
    ) -> RunnerConfig:
        device = cfg.device
        if device == "cuda" and world_size > 1:  # one GPU per rank of this node
            device = f"cuda:{rank % (world_size // cfg.nnodes)}"
        return cls(
            model_path=model_path,
            device=device,
            dtype=cfg.resolved_dtype(),
            kv_cache_dtype=cfg.kv_cache_dtype,
            quantization=cfg.quantization,
            load_format=cfg.load_format,
            num_kv_slots=cfg.kv_slot_cap(),
            mem_fraction_static=cfg.resolved_mem_fraction_static(),
            max_reqs=cfg.resolved_max_running_requests(),
            max_model_len=max_model_len,
            page_size=cfg.page_size,
            seed=cfg.seed,
            attention_backend=cfg.attention_backend,
            cuda_graph=not cfg.disable_cuda_graph,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            swa_replay_tokens=cfg.swa_replay_tokens,
            swa_replay_exact=cfg.swa_replay_exact,
            hf_overrides=cfg.hf_overrides,
            cpu_threads=cfg.cpu_threads,
            max_prefill_tokens=cfg.resolved_chunked_prefill_size(),
            rank=rank,
            world_size=world_size,
            tp_size=cfg.attention_tp_size() if world_size > 1 else 1,
            ep_size=cfg.ep_size if world_size > 1 else 1,
            ep_num_redundant_experts=cfg.ep_num_redundant_experts,
            expert_placement=cfg.expert_placement,
            moe_a2a_backend=cfg.moe_a2a_backend,
            expert_load_out=cfg.expert_load_out,
            dist_init_addr=dist_init_addr,
            speculative_algorithm=cfg.speculative_algorithm,
            speculative_num_draft_tokens=cfg.speculative_num_draft_tokens,
            speculative_ngram_sizes=(
                cfg.speculative_ngram_min_match_window_size,
                cfg.speculative_ngram_max_match_window_size,
            ),
            speculative_draft_model_path=cfg.speculative_draft_model_path,
            tokenizer=cfg.tokenizer,
            engram=EngramOptions(
                cfg.engram_placement,
                cfg.engram_shards,
                not cfg.disable_engram_prefetch,
                cfg.engram_lookup_delay_ms / 1000,
            ),
        )


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One DP rank's scheduler."""

    num_kv_slots: int  # the pool's token slots (slot 0 included)
    page_size: int
    max_running_requests: int
    max_model_len: int
    chunked_prefill_size: int  # the step's token budget
    schedule_policy: str = "fcfs"
    init_new_token_ratio: float = INIT_NEW_TOKEN_RATIO  # reserved share of a request's remaining tokens
    overlap: bool = True
    radix_cache: bool = True
    max_queued_requests: int = 4096
    prefix_replay: int = 0  # tokens before a prefix hit the worker recomputes (DeepSeek-V4's state)
    max_draft: int = 0  # speculative decoding: the most draft tokens a row may verify (0: off)
    verify_ahead: bool = False  # rows may be planned before their verify step's counts are known
    compute_bound_tokens: int = 1024  # the step tokens at which verifying drafts stops being cheap
    fixed_draft: bool = False  # verify every draft held (ServerConfig.speculative_draft_policy)

    @classmethod
    def resolve(cls, cfg: ServerConfig, caps: WorkerCapabilities) -> SchedulerConfig:
        return cls(
            num_kv_slots=caps.num_kv_slots,
            page_size=caps.page_size,
            max_running_requests=caps.max_reqs,
            max_model_len=caps.max_model_len,
            chunked_prefill_size=cfg.resolved_chunked_prefill_size(),
            schedule_policy=cfg.schedule_policy,
            init_new_token_ratio=min(INIT_NEW_TOKEN_RATIO * cfg.schedule_conservativeness, 1.0),
            overlap=not cfg.disable_overlap,
            radix_cache=caps.prefix_cache and not cfg.disable_radix_cache,
            max_queued_requests=cfg.max_queued_requests,
            prefix_replay=caps.prefix_replay,
            max_draft=caps.max_draft,
            verify_ahead=caps.verify_ahead,
            compute_bound_tokens=caps.compute_bound_tokens,
            fixed_draft=cfg.speculative_draft_policy == "fixed",
        )


# Per-layer lists that must shrink with `num_hidden_layers` (V4's `compress_ratios` is cut by transformers).
_PER_LAYER_KEYS = ("layer_types", "mlp_layer_types")


def apply_hf_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json contents with `overrides` merged in (nested dicts key by key, like vLLM), before any
    config class sees them, so derived fields follow. Fewer `num_hidden_layers` keeps the first layers:
    per-layer lists are cut to the new count."""
    if not overrides:
        return config
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    n = overrides.get("num_hidden_layers")
    if n is not None:
        for key in _PER_LAYER_KEYS:
            if isinstance(out.get(key), list) and key not in overrides:
                out[key] = out[key][:n]
    return out
