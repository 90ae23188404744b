"""The OpenAI request bodies, their validation, and their translation into engine requests.

`parse_chat` / `parse_completion` turn a raw body into a `Job`: the engine requests to run (one per
choice: `n` samples of each prompt) plus what the response needs. Every failure is a `ConduitError`
naming the field (`param` is its JSON path, e.g. "messages[0].role").
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import msgspec

from runtime.errors import InvalidRequest, NotFound
from runtime.http import tools as tooling
from runtime.http.options import ServingOptions
from runtime.mailbox.messages import (
    ChatMessage,
    Disagg,
    GenerateRequest,
    GrammarSpec,
    SamplingParams,
    ToolCall,
)
from runtime.structured import specs

MAX_N = 16  # samples per prompt
MAX_CHOICES = 256  # engine requests one HTTP request may fan out to (n x batched prompts)
MAX_LOGPROBS = 20
MAX_STOP = 16  # stop strings per request, each at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
INT64 = (-(2**63), 2**63 - 1)  # `seed`: what the engine's messages carry (msgpack ints are 64-bit)
INT32 = (-(2**31), 2**31 - 1)  # other integers that travel to the engine (`top_k`, `priority`)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's, SGLang's) default for /v1/completions
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})

Endpoint = Literal["chat", "completions"]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: CalledFunction


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (DeepSeek)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints; `None` everywhere a client may send `null`."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # extensions sent by SGLang / vLLM clients
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = True
    priority: int | None = 0
    # accepted so that a request using them fails loudly instead of being silently ignored
    logit_bias: dict[str, float] | None = None
    # structured output: OpenAI's response_format, SGLang's regex / ebnf (runtime/structured)
    response_format: dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    # prefill/decode disaggregation, set by `conduit gateway --pd-disaggregation` (docs/disaggregation.md):
    # the transfer's id on both servers, and (prefill only) the decode server's transfer address
    bootstrap_room: int | None = None
    bootstrap_addr: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[tooling.Tool] | None = None
    tool_choice: tooling.ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


def _disagg(req: _Common, options: ServingOptions, choices: int) -> Disagg | None:
    """The request's side of a disaggregated transfer, checked against the server's mode."""
    room, addr = req.bootstrap_room, req.bootstrap_addr
    mode = options.disaggregation["mode"] if options.disaggregation else None
    if room is None and addr is None:
        return None
    if mode is None:
        raise InvalidRequest(
            "`bootstrap_room` is only for servers started with --disaggregation-mode.", param="bootstrap_room"
        )
    if room is None:
        raise InvalidRequest("`bootstrap_addr` needs `bootstrap_room`.", param="bootstrap_room")
    if (mode == "prefill") != (addr is not None):
        raise InvalidRequest(
            "A prefill server needs `bootstrap_addr` (the decode server's transfer address); a decode "
            "server takes none.",
            param="bootstrap_addr",
        )
    if choices != 1:
        raise InvalidRequest("A disaggregated request has one prompt and n=1.", param="n")
    return Disagg(room, addr)


@dataclass(frozen=True)
class Job:
    """One HTTP (or WebSocket) request: `requests[i]` produces choice `i`, sample `i % n` of prompt `i // n`."""

    endpoint: Endpoint
    id: str
    created: int
    model: str
    requests: list[GenerateRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs; k: the chosen token's plus k alternatives
    output: tooling.OutputSpec | None = None  # chat: reasoning and tool calls to split from the text


_DECODERS = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completions": msgspec.json.Decoder(CompletionRequest),
}
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def decode_body(
    endpoint: Endpoint, body: bytes, *, path: str = ""
) -> ChatCompletionRequest | CompletionRequest:
    """Strictly typed decode; malformed JSON and wrong types become `InvalidRequest` naming the field.
    `path` prefixes the field's JSON path (the WebSocket's bodies live under "request")."""
    try:
        return _DECODERS[endpoint].decode(body)
    except msgspec.ValidationError as e:
        raise validation_error(e, path) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"The request body is not valid JSON: {e}", code="invalid_json") from None


def validation_error(e: msgspec.ValidationError, path: str = "") -> InvalidRequest:
    """msgspec's "Expected `int`, got `str` - at `$.messages[0].role`" as an error with that `param`."""
    m = _AT.match(str(e))
    assert m is not None
    parts = [p for p in (path, (m["path"] or "").lstrip(".")) if p]
    if missing := _MISSING.search(m["msg"]):
        parts.append(missing["field"])
    param = ".".join(parts).replace(".[", "[") or None
    where = f" (at `{param}`)" if param else ""
    return InvalidRequest(f"{m['msg']}{where}", param=param)


def parse_chat(
    body: bytes, *, served_model: str, max_model_len: int = 0, options: ServingOptions | None = None
) -> Job:
    return build_job(
        "chat",
        decode_body("chat", body),
        served_model=served_model,
        max_model_len=max_model_len,
        options=options,
    )


def parse_completion(
    body: bytes, *, served_model: str, max_model_len: int = 0, options: ServingOptions | None = None
) -> Job:
    req = decode_body("completions", body)
    return build_job(
        "completions", req, served_model=served_model, max_model_len=max_model_len, options=options
    )


def build_job(
    endpoint: Endpoint,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    served_model: str,
    max_model_len: int = 0,
    stream: bool | None = None,
    options: ServingOptions | None = None,
) -> Job:
    """Validate a decoded body and build its engine requests. `stream` overrides the body's (WebSocket)."""
    options = options or ServingOptions()
    if req.model is not None and req.model != served_model:
        raise NotFound(f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    n = _check_range("n", req.n, 1, 1, MAX_N)
    if req.logit_bias:
        raise InvalidRequest("`logit_bias` is not supported.", param="logit_bias")
    constraint = specs.from_fields(req.response_format, req.regex, req.ebnf)
    extra: dict = {}  # chat: tools and template variables for every engine request
    output = None
    streaming = bool(req.stream) if stream is None else stream
    if req.stream_options is not None and not streaming:
        raise InvalidRequest(
            "`stream_options` is only allowed when `stream` is true.", param="stream_options"
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if isinstance(req, ChatCompletionRequest):
        prompts: list[dict] = [{"messages": _chat_messages(req)}]
        extra["chat_template_kwargs"] = _template_kwargs(req)
        extra["tools"], constraint, output = tooling.plan_chat(
            tools=tooling.function_tools(req.tools),
            tool_choice=req.tool_choice,
            parallel=req.parallel_tool_calls,
            constraint=constraint,
            tool_parser=options.tool_call_parser,
            reasoning_parser=options.reasoning_parser,
            template_kwargs=extra["chat_template_kwargs"],
        )
        logprobs = _chat_logprobs(req)
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex}"
    else:
        if req.echo:
            raise InvalidRequest("`echo` is not supported.", param="echo")
        if req.suffix:
            raise InvalidRequest("`suffix` is not supported.", param="suffix")
        prompts = _completion_prompts(req.prompt)
        logprobs = _check_range("logprobs", req.logprobs, None, 0, MAX_LOGPROBS)
        max_tokens_param = "max_tokens"
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = options.sampling_defaults.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        rid = f"cmpl-{uuid.uuid4().hex}"

    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest(f"At most {MAX_CHOICES} choices (prompts x n) per request.", param="n")
    params = _sampling_params(req, max_tokens, max_tokens_param, logprobs, max_model_len, options, constraint)
    if output is not None and output.tool_parser is not None:
        # call markers are special tokens in DeepSeek's vocabularies: the parser must see them (SGLang too)
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    disagg = _disagg(req, options, len(prompts) * n)
    priority = _check_range("priority", req.priority, 0, *INT32)
    arrival = time.time()
    requests = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            i = p * n + j
            sub_params = params
            if params.seed is not None and i > 0:
                sub_params = msgspec.structs.replace(params, seed=params.seed + i)
            sub_rid = rid if len(prompts) * n == 1 else f"{rid}-{i}"
            add_gen = isinstance(req, CompletionRequest) or req.add_generation_prompt is not False
            requests.append(
                GenerateRequest(
                    rid=sub_rid,
                    params=sub_params,
                    priority=priority,
                    arrival=arrival,
                    add_generation_prompt=add_gen,
                    disagg=disagg,
                    **prompt,
                    **extra,
                )
            )
    return Job(
        endpoint=endpoint,
        id=rid,
        created=int(arrival),
        model=served_model,
        requests=requests,
        n=n,
        stream=streaming,
        include_usage=include_usage,
        logprobs=logprobs,
        output=output if output is not None and output.active else None,
    )


def _chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    if not req.messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"Unsupported role `{m.role}`; expected one of {sorted(CHAT_ROLES)}.",
                param=f"messages[{i}].role",
            )
        if m.content is None:
            if m.role != "assistant":
                raise InvalidRequest("`content` is required.", param=f"messages[{i}].content")
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"Only text content parts are supported (got `{part.type}`).",
                        param=f"messages[{i}].content[{j}]",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        # chat templates know `system`; OpenAI's `developer` is the same instruction slot
        role = "system" if m.role == "developer" else m.role
        out.append(
            ChatMessage(
                role=role,
                content=text,
                tool_calls=_tool_calls(m, i),
                tool_call_id=m.tool_call_id,
                name=m.name,
                reasoning_content=m.reasoning_content,
            )
        )
    return out


def _tool_calls(m: Message, i: int) -> list[ToolCall] | None:
    if not m.tool_calls:
        return None
    if m.role != "assistant":
        raise InvalidRequest("Only assistant messages carry `tool_calls`.", param=f"messages[{i}].tool_calls")
    calls = []
    for j, c in enumerate(m.tool_calls):
        args = c.function.arguments
        text = args if isinstance(args, str) else msgspec.json.encode(args).decode()
        calls.append(ToolCall(id=c.id or f"call_{i}_{j}", name=c.function.name, arguments=text))
    return calls


def _template_kwargs(req: ChatCompletionRequest) -> dict | None:
    """`chat_template_kwargs` (DeepSeek's `thinking`, ...) plus `reasoning_effort`, for the template."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in tooling.REASONING_EFFORTS:
            raise InvalidRequest(
                f"`reasoning_effort` must be one of {sorted(tooling.REASONING_EFFORTS)}.",
                param="reasoning_effort",
            )
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs or None


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    top = _check_range("top_logprobs", req.top_logprobs, None, 0, MAX_LOGPROBS)
    if not req.logprobs:
        if top:
            raise InvalidRequest("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs")
        return None
    return top or 0


def _completion_prompts(prompt: str | list[str | int | list[int]]) -> list[dict]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise InvalidRequest("`prompt` must not be empty.", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_ids": _token_ids(prompt, "prompt")}]
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_ids": _token_ids(p, f"prompt[{i}]")} for i, p in enumerate(prompt)]
    raise InvalidRequest(
        "`prompt` must be a string, a list of strings, a list of token ids, or a list of lists of token ids.",
        param="prompt",
    )


def _token_ids(ids: list, param: str) -> list[int]:
    if not ids:
        raise InvalidRequest("A token-id prompt must not be empty.", param=param)
    if any(t < 0 for t in ids):
        raise InvalidRequest("Token ids must be non-negative.", param=param)
    return ids


def _sampling_params(
    req: _Common,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    max_model_len: int,
    options: ServingOptions,
    grammar: GrammarSpec | None,
) -> SamplingParams:
    hi = max_model_len if max_model_len > 0 else None
    d = options.sampling_defaults  # the model's generation_config.json, where the request is silent
    if max_tokens is None and d.max_tokens is not None and hi is not None:
        max_tokens = min(d.max_tokens, hi)
    max_tokens = _check_range(max_tokens_param, max_tokens, d.max_tokens, 1, hi)
    temperature = _check_range("temperature", req.temperature, _default(d.temperature, 1.0), 0.0, 2.0)
    top_p = _check_range("top_p", req.top_p, _default(d.top_p, 1.0), 0.0, 1.0)
    if top_p <= 0.0:
        raise InvalidRequest("`top_p` must be in (0, 1].", param="top_p")
    top_k = _check_range("top_k", req.top_k, _default(d.top_k, -1), -1, INT32[1])
    min_p = _check_range("min_p", req.min_p, _default(d.min_p, 0.0), 0.0, 1.0)
    rep = _check_range(
        "repetition_penalty", req.repetition_penalty, _default(d.repetition_penalty, 1.0), 0.0, 2.0
    )
    if rep <= 0.0:
        raise InvalidRequest("`repetition_penalty` must be in (0, 2].", param="repetition_penalty")
    min_tokens = _check_range("min_tokens", req.min_tokens, 0, 0, max_tokens)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check_stop(stop, list(req.stop_token_ids or []))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=_check_range("frequency_penalty", req.frequency_penalty, 0.0, -2.0, 2.0),
        presence_penalty=_check_range("presence_penalty", req.presence_penalty, 0.0, -2.0, 2.0),
        seed=_check_range("seed", req.seed, None, *INT64),
        stop=[s for s in stop if s],
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
        grammar=grammar,
    )


def _default(value, fallback):
    return fallback if value is None else value


def _check_stop(stop: list[str], stop_token_ids: list[int]) -> None:
    if len(stop) > MAX_STOP:
        raise InvalidRequest(f"At most {MAX_STOP} `stop` strings (got {len(stop)}).", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(f"A `stop` string is at most {MAX_STOP_CHARS} characters long.", param="stop")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"At most {MAX_STOP_TOKEN_IDS} `stop_token_ids`.", param="stop_token_ids")
    if any(not 0 <= t <= INT32[1] for t in stop_token_ids):
        raise InvalidRequest("`stop_token_ids` must be token ids (non-negative).", param="stop_token_ids")


def _check_range(param: str, value, default, lo, hi):
    """`value` (or `default` when null/absent) checked against [lo, hi]; None bounds are open."""
    if value is None:
        return default
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise InvalidRequest(f"`{param}` must be {bounds} (got {value}).", param=param)
    return value
