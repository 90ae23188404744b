"""The protocol: every message that travels between actors, and nothing else.

Grouped by direction along a request's path (see docs/ARCHITECTURE.md):

    EngineClient --GenerateRequest/AbortRequest--> Tokenizer --TokenizedRequest/AbortRequest--> Scheduler
    Tokenizer --TrackRequest--> Detokenizer
    GpuWorker --WorkerCapabilities--> Scheduler        (once, at start-up)
    Scheduler --StepPlan--> GpuWorker --StepOutput--> Scheduler
    Scheduler --TokenBatch--> Detokenizer --TextDeltas--> EngineClient
    any actor --RequestFailed--> EngineClient          (the final message of a failed request)
    Scheduler --KVReserve/KVCancel--> GpuWorker --KVArrived--> Scheduler   (decode side of disaggregation)
    GpuWorker --KVSent--> Scheduler                    (prefill side of disaggregation)

Rules: structs are frozen and tagged so one decoder handles the union; all are `array_like` (encoded as
msgpack arrays, no field names on the wire; msgspec needs one layout across a union); per-step messages are columnar (one message per
step for all requests, not one per token); no tensors ever travel here.
"""

from __future__ import annotations

from typing import Any

import msgspec

Struct = msgspec.Struct


class GrammarSpec(Struct, frozen=True, kw_only=True):
    """A constraint on a request's output, enforced by masking the logits each step (runtime/structured).

    `kind`: "json_schema" | "json_object" | "regex" | "ebnf" | "structural_tag"; `spec` is the schema,
    pattern, grammar or structural tag as JSON text (empty for json_object)."""

    kind: str
    spec: str = ""


class SamplingParams(Struct, frozen=True, kw_only=True):
    """What the user asked for; validated by the HTTP layer, read by scheduler, sampler, detokenizer."""

    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (HF/vLLM semantics)
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus k top alternatives
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output / forced tool calls

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class ToolCall(Struct, frozen=True):
    """A function call an assistant made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatMessage(Struct, frozen=True):
    role: str
    content: str
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this result answers
    name: str | None = None
    reasoning_content: str | None = None  # assistant: its earlier reasoning (DeepSeek templates)


class FunctionTool(Struct, frozen=True, kw_only=True):
    """A function the model may call (OpenAI `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The `{"type": "function", "function": {...}}` shape chat templates expect."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


# ---------------------------------------------------------------- client -> tokenizer -> scheduler


class Disagg(Struct, frozen=True, array_like=True):
    """A request of prefill/decode disaggregation (runtime/disaggregation): `room` names its KV transfer
    on both servers; `peer` is the decode server's transfer address (host:port), set on the prefill side
    only (the prefill server sends the KV there; the decode server waits for it)."""

    room: int
    peer: str | None = None


class GenerateRequest(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """One generation. Exactly one of `prompt`, `messages`, `prompt_ids` is set."""

    rid: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_ids: list[int] | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    arrival: float = 0.0  # time.time() at the frontend, for queueing metrics
    tools: list[FunctionTool] | None = None  # given to the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (thinking, ...)
    disagg: Disagg | None = None  # prefill/decode disaggregation (runtime/disaggregation)


class TokenizedRequest(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stop_ids: list[int]  # EOS ids (unless ignore_eos) plus the user's stop_token_ids
    max_new_tokens: int  # resolved against the context length
    priority: int = 0
    arrival: float = 0.0
    disagg: Disagg | None = None


class AbortRequest(Struct, frozen=True, tag=True, array_like=True):
    """Stop a request. Sent by the client (disconnect, WS abort) through the tokenizer, so it never
    overtakes the request it aborts; sent by the detokenizer when a stop string matched."""

    rid: str
    reason: str = "abort"  # "abort" (client) or "stop" (stop string found by the detokenizer)


class TrackRequest(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Tokenizer -> detokenizer: per-request decoding state, registered before the scheduler sees it."""

    rid: str
    prompt_tokens: int
    stop: list[str]
    skip_special_tokens: bool
    logprobs: int | None
    prompt_tail: list[int] = []  # the prompt's last few ids: decoding context for the first output tokens


# ---------------------------------------------------------------- scheduler <-> gpu worker


class SeqStart(Struct, frozen=True, array_like=True):
    """A request entering the worker's request table at `row` (on admission or re-admission).

    A request re-admitted after a retraction brings the tokens it generated before (`output_ids`): the
    sampler rebuilds its penalty counts and min_tokens progress from them, and its seeded draws resume at
    token index len(output_ids), so its sampling continues as if it had never left."""

    row: int
    params: SamplingParams
    prompt_ids: list[int]  # for repetition penalties
    prefix_slots: list[int]  # KV slots of the cached prefix, written to req_to_token[row, :len]
    stop_ids: list[int]  # banned until min_tokens is reached
    output_ids: list[int] = []  # tokens generated before a retraction (empty on first admission)
    transfer: Disagg | None = None  # prefill side of disaggregation: send this row's KV once it samples


class StepPlan(Struct, frozen=True, tag=True, array_like=True):
    """One forward step. Per-row columns share an order; flattened columns are concatenated in it.

    A row with `use_last` feeds back its own last sampled token, which the worker keeps on the device,
    so plan N+1 can be sent before step N's tokens reach the host (overlap scheduling).

    Speculative decoding: a row with `draft_lens[i] = k > 0` verifies k draft tokens. Its inputs are its
    last token and the k drafts its worker's drafter proposed after the row's previous step (all on the
    device, so `use_last` is set and extend_lens[i] is k + 1); every one of its k + 1 positions is
    sampled, and the row emits the accepted drafts plus one token (StepOutput.counts).

    Overlap with speculation: a row whose previous step verified drafts may be planned before that step's
    counts reach the scheduler (`assume_accepted[i]`). Its prefix_lens[i] then assumes every one of
    those drafts accepted, and its out_loc entries are the slots of positions prefix_lens[i] ..; the
    worker moves the row back by the drafts that step rejected (kept on the device per row), and its new
    tokens take the slots of the positions they really have: the rejected drafts' own first, then the
    plan's. The scheduler reserved the worst case and trims what was not used when the counts arrive."""

    step: int
    added: list[SeqStart]
    released: list[int]  # rows whose requests left; the worker forgets their sampling state
    rows: list[int]
    prefix_lens: list[int]  # tokens already in KV for the row before this step
    extend_lens: list[int]  # tokens this step adds for the row
    use_last: list[bool]  # True: the row's one input token is its last sampled token (decode)
    input_ids: list[int]  # tokens of the rows without use_last, concatenated
    out_loc: list[int]  # KV slots for every new token, concatenated (sum(extend_lens) entries)
    sample: list[bool]  # False for a prefill chunk that does not end the prompt
    # Per row (empty: all 0): how many of its leading tokens are replayed, i.e. recomputed only to rebuild
    # per-request state before a cached prefix (DeepSeek-V4's sliding-window ring and compressor tails).
    # Their KV slots are the cached prefix's own, which the step must not overwrite.
    replay: list[int] = []
    # Per row (empty: all 0): draft tokens the row verifies (speculative decoding, see above).
    draft_lens: list[int] = []
    # Per row (empty: all False): planned before its previous verify step's counts were known (see above).
    assume_accepted: list[bool] = []
    # Engram models: every token's table rows, int64 little-endian [tokens, columns], computed by the
    # scheduler from token ids (runtime/engram/addresses.py); empty otherwise
    engram_addr: bytes = b""
    # Speculative decoding: False when no row of this step may verify drafts made after it (each is in a
    # cooldown or below the load's threshold, `DraftPolicy.wants_drafts`): the worker's drafter then only
    # records the step's tokens, so a workload where speculation switched itself off skips the drafting.
    propose: bool = True


class EngramCounters(Struct, frozen=True, array_like=True):
    """Engram lookups since start (cumulative, from the worker's placement)."""

    lookups: int = 0  # one per step of an Engram model
    rows: int = 0  # table rows fetched (tokens * tables)
    fetch_s: float = 0.0  # time from a fetch's start to its rows being ready
    wait_s: float = 0.0  # time the forward waited for rows (the part the prefetch did not hide)
    shard_restarts: int = 0  # host placement: shard processes restarted after a crash


class StepOutput(Struct, frozen=True, tag=True, array_like=True):
    step: int
    rows: list[int]  # the rows that sampled, in plan order
    tokens: list[int]  # every row's emitted tokens, concatenated in row order
    logprobs: list[float] | None = None  # each token's logprob, where any row asked for logprobs
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    forward_s: float = 0.0  # host time from launch to results, for metrics
    gpu_start: float = 0.0  # device time the step began / ended, seconds since the worker's first step
    gpu_end: float = 0.0  # (CUDA only): the gaps between steps are device idle time
    # Speculative decoding (empty when no row of the step verified drafts or has a drafter):
    counts: list[int] = []  # tokens each row emitted (accepted drafts + 1; 1 for a plain row)
    draft_s: float = 0.0  # time the drafter took after this step (device time on CUDA)
    # per row, the drafter's proposals for the row's next step: how many, and its confidence in each
    draft_counts: list[int] = []
    draft_conf: list[list[float]] = []
    engram: EngramCounters | None = None  # Engram models: the worker's lookup counters


class WorkerCapabilities(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Worker -> its scheduler, once at start-up: what the loaded model and its KV pool can do. The
    scheduler is configured from it (`SchedulerConfig.resolve`), so it never probes the worker."""

    rank: int
    model: str  # the model class, for logs
    num_kv_slots: int  # the pool's token slots, slot 0 included
    page_size: int  # the pool's page size (the asked one, raised to the model's page multiple)
    max_reqs: int  # request rows (row 0 excluded)
    max_model_len: int
    prefix_cache: bool  # False: per-request state cannot start from a cached prefix (no radix cache)
    prefix_replay: int  # tokens before a prefix hit that rebuild per-request state (0: none)
    kv_bytes_per_token: int
    vocab_size: int
    max_draft: int = 0  # speculative decoding: drafts a row may verify per step (0: no drafter)
    # speculative decoding: rows may be planned before their previous verify step's counts are known
    # (StepPlan.assume_accepted): the drafter drafts on the device right after a step
    verify_ahead: bool = False
    engram: bool = False  # the model has Engram layers: plans carry their addresses (StepPlan.engram_addr)
    # step tokens from which more positions cost compute rather than riding on the weight reads: where
    # speculation's draft-length threshold reaches its maximum (the device's ridge point, roughly)
    compute_bound_tokens: int = 1024


class KVReserve(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Decode side of disaggregation, scheduler -> worker: the KV of transfer `room` goes to `row` and
    `slots` (its positions 0..len-1) when it arrives. `released`: rows to forget first (rows freed since
    the last StepPlan, which would otherwise release them after the import)."""

    room: int
    rid: str
    row: int
    slots: list[int]
    released: list[int] = []


class KVCancel(Struct, frozen=True, tag=True, array_like=True):
    """Scheduler -> worker: forget reservation `room` (its request ended): a late arrival is dropped."""

    room: int


class KVArrived(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Decode worker -> scheduler: transfer `room` is in its slots and row (or failed: `error`), with the
    prefill's first token and its logprobs (`logprob` None when none were asked for)."""

    room: int
    token: int = -1
    logprob: float | None = None
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    error: str | None = None


class KVSent(Struct, frozen=True, tag=True, array_like=True):
    """Prefill worker -> scheduler: the KV of transfer `room` reached its decode server (or not: `error`)."""

    room: int
    error: str | None = None


class WorkerFailed(Struct, frozen=True, tag=True, array_like=True):
    """The worker could not run a step; the scheduler fails the step's requests and marks unhealthy."""

    step: int
    error: str


class StepAborted(Struct, frozen=True, tag=True, array_like=True):
    """The worker could not run a step for a reason outside the device (an Engram shard crashed,
    runtime.errors.StepFailed): the scheduler fails that step's requests and keeps serving."""

    step: int
    error: str


# ---------------------------------------------------------------- scheduler -> detokenizer -> client


class TokenLogprobs(Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class TokenBatch(Struct, frozen=True, tag=True, array_like=True):
    """All new tokens of one step, columnar. `finished[i]` is None while the request runs, else the
    finish reason ("stop", "length", "abort")."""

    rids: list[str]
    tokens: list[list[int]]
    finished: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprobs] | None]


class TextDelta(Struct, frozen=True, array_like=True):
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    tokens_text: list[str] | None = None  # decoded text of each token, where logprobs were asked for
    top_tokens_text: list[list[str]] | None = None  # decoded text of each token's top alternatives


class TextDeltas(Struct, frozen=True, tag=True, array_like=True):
    items: list[TextDelta]


class RequestFailed(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """The final message of a request that could not be served. `status` is the HTTP status to answer."""

    rid: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


# ---------------------------------------------------------------- control and stats


class SpecCounters(Struct, frozen=True, array_like=True, kw_only=True):
    """Cumulative speculative decoding figures of a scheduler (EngineStats.spec)."""

    steps: int  # steps with a row verifying drafts
    rows: int  # verify rows (one row verifying in one step)
    drafted: int  # drafts verified
    accepted: int  # drafts accepted
    per_position: list[int]  # [K]: how often draft j+1 was accepted
    reached: list[int]  # [K]: how often draft j+1 was verified
    lengths: list[int]  # [K+1]: verify rows that emitted 1 .. K+1 tokens
    draft_s: float  # time spent drafting (device time on CUDA)
    verify_s: float  # time of the steps with verify rows
    ahead_rows: int = 0  # verify rows planned before their previous verify step's counts were known


class EngineStats(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Scheduler -> client after steps (throttled): what /metrics and /health report."""

    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    healthy: bool = True
    error: str | None = None
    steps: int = 0
    plan_s: float = 0.0  # cumulative scheduler planning time
    cached_tokens: int = 0  # cumulative prefix-cache hits (tokens)
    prompt_tokens: int = 0  # cumulative prompt tokens admitted
    retractions: int = 0
    evictable_tokens: int = 0
    protected_tokens: int = 0
    wait_s: float = 0.0  # cumulative scheduler time idle with steps in flight (waiting for the worker)
    output_s: float = 0.0  # cumulative scheduler time processing step outputs
    gpu_busy_s: float = 0.0  # cumulative device time inside steps (CUDA)
    gpu_idle_s: float = 0.0  # cumulative device idle time between consecutive steps (CUDA)
    swa_replay_tokens: int = 0  # cumulative tokens replayed to rebuild per-request state on prefix hits
    spec: SpecCounters | None = None  # speculative decoding, when it is on
    engram: EngramCounters | None = None  # Engram models
    dp_rank: int = 0  # the DP rank whose scheduler sent it (the DP controller sums them)


class FlushCache(Struct, frozen=True, tag=True, array_like=True):
    """Client -> scheduler: drop every cached prefix (refused while requests run or wait)."""

    id: int = 0  # echoed in the CacheFlushed answer


class CacheFlushed(Struct, frozen=True, tag=True, array_like=True):
    """Scheduler -> client: the answer to FlushCache `id`, sent after fresh EngineStats."""

    id: int
    ok: bool


# ---------------------------------------------------------------- Engram client <-> shard servers


class EngramLookup(Struct, frozen=True, tag=True, array_like=True):
    """Worker's Engram client -> an EngramShardActor: gather the rows you own of `n` addresses. Both
    sides map shared memory `segment`: n * columns int64 addresses first, then the output rows
    [n, columns, head_dim], where each shard writes the entries it owns (no rows cross the socket)."""

    id: int
    n: int
    columns: int
    segment: str
    reply_to: str


class EngramLookupDone(Struct, frozen=True, tag=True, array_like=True):
    """EngramShardActor -> the client: lookup `id`'s rows of this shard are in the segment."""

    id: int
    shard: int
    rows: int  # entries this shard owned


class NodeReady(Struct, frozen=True, tag=True, array_like=True):
    """A child process's actors are started (model loaded); sent to the parent's system endpoint."""

    node: str
    info: dict[str, str] = {}


class NodeFailed(Struct, frozen=True, tag=True, array_like=True):
    node: str
    error: str


class Shutdown(Struct, frozen=True, tag=True, array_like=True):
    pass


Message = (
    GenerateRequest
    | TokenizedRequest
    | AbortRequest
    | TrackRequest
    | StepPlan
    | StepOutput
    | WorkerCapabilities
    | WorkerFailed
    | KVReserve
    | KVCancel
    | KVArrived
    | KVSent
    | StepAborted
    | TokenBatch
    | TextDeltas
    | RequestFailed
    | EngineStats
    | FlushCache
    | CacheFlushed
    | EngramLookup
    | EngramLookupDone
    | NodeReady
    | NodeFailed
    | Shutdown
)


class Envelope(Struct, frozen=True, array_like=True):
    """What crosses a process boundary: the destination actor's name and the message."""

    to: str
    msg: Message
