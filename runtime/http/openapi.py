"""GET /openapi.json: the HTTP API described from the models the handlers use.

Request bodies are the msgspec structs the routes decode with (runtime/http/protocol.py), so a field added
there appears here. Responses are the structs below, the shapes runtime/http/formatting.py writes; the
integration tests decode every response and stream chunk they receive with these structs
(tests/integration/test_schema_fuzz.py), so the description and the handlers cannot drift apart
unnoticed. The WebSocket's messages are components too (runtime/http/websocket.py)."""

from __future__ import annotations

from typing import Literal

import msgspec

from runtime.http import protocol
from runtime.http.protocol import ChatCompletionRequest, CompletionRequest
from runtime.http.websocket import WsAbort, WsGenerate

Struct = msgspec.Struct


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    """Every 4xx/5xx answer (and an SSE `data:` event when a stream fails after its first token)."""

    error: ErrorDetail


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class AssistantMessage(Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct, kw_only=True):
    """One SSE `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with stream_options.include_usage: null, then one last chunk with it


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the top alternatives, and the sampled token when not among them
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Struct, kw_only=True):
    """A /v1/completions answer, and (object "text_completion" too) each SSE event of its stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Struct):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Struct, kw_only=True):
    status: Literal["ok", "unhealthy", "shutting_down"]
    error: ErrorDetail | None = None


class Status(Struct):
    status: Literal["ok"]


class WsDelta(Struct, kw_only=True):
    type: Literal["delta"]
    id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: dict | None = None  # chat: a ChatLogprobs; completions: a CompletionLogprobs


class WsDone(Struct):
    type: Literal["done"]
    id: str
    finish_reason: str
    finish_reasons: list[str]
    usage: Usage


class WsError(Struct):
    type: Literal["error"]
    id: str | None
    error: ErrorDetail


REQUESTS = (ChatCompletionRequest, CompletionRequest, WsGenerate, WsAbort)
RESPONSES = (ErrorResponse, ChatCompletion, ChatCompletionChunk, Completion, ModelList, ModelCard, Health)
WS_SERVER_MESSAGES = (WsDelta, WsDone, WsError)
_ERRORS = {
    "400": "Invalid request (the field is named in `error.param`), or a limit exceeded",
    "404": "Unknown model or route",
    "413": "Request body over --max-body-bytes",
    "429": "Too many queued requests (Retry-After)",
    "503": "Engine unhealthy or restarting, or the server shutting down (Retry-After)",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*codes: str) -> dict:
    return {c: {"description": _ERRORS[c], "content": _json("ErrorResponse")} for c in codes}


def _generation(summary: str, body: str, answer: str, chunk: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {
                "200": {
                    "description": f"`stream: false`: a {answer}; `stream: true`: server-sent events, each "
                    f"`data:` a {chunk} (or an ErrorResponse if it fails after its first token), then "
                    "`data: [DONE]`",
                    "content": {**_json(answer), "text/event-stream": {"schema": {"type": "string"}}},
                },
                **_errors("400", "404", "413", "429", "503"),
            },
        }
    }


def _limits(components: dict) -> None:
    """The limits protocol.py checks (its constants), added to the fields they bound."""
    msg = components["Message"]["properties"]
    msg["role"] = {"enum": sorted(protocol.CHAT_ROLES), "description": "`developer` is a system message"}
    for name, lo, hi in (
        ("n", 1, protocol.MAX_N),
        ("top_logprobs", 0, protocol.MAX_LOGPROBS),
        ("seed", *protocol.INT64),
        ("priority", *protocol.INT32),
    ):
        for body in ("ChatCompletionRequest", "CompletionRequest"):
            field = components[body]["properties"].get(name)
            if field is not None:
                field["anyOf"][0] |= {"minimum": lo, "maximum": hi}
    components["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0] |= {
        "minimum": 0,
        "maximum": protocol.MAX_LOGPROBS,
    }
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        stop = components[body]["properties"]["stop"]["anyOf"]
        stop[0] |= {"maxLength": protocol.MAX_STOP_CHARS}
        stop[1] |= {
            "maxItems": protocol.MAX_STOP,
            "items": {"type": "string", "maxLength": protocol.MAX_STOP_CHARS},
        }


def document(served_model: str) -> dict:
    """The OpenAPI 3.1 document of this server."""
    types = REQUESTS + RESPONSES + WS_SERVER_MESSAGES + (Status,)
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    _limits(components)
    paths = {
        "/v1/chat/completions": _generation(
            "Chat completion (OpenAI)", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
        ),
        "/v1/completions": _generation(
            "Text completion (OpenAI)", "CompletionRequest", "Completion", "Completion"
        ),
        "/v1/models": {
            "get": {"summary": "The served model", "responses": {"200": {"description": "", "content": _json("ModelList")}}}
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "", "content": _json("ModelCard")}, **_errors("404")},
            }
        },
        "/health": {
            "get": {
                "summary": "200 while the engine serves; 503 while it is unhealthy, restarting or draining",
                "responses": {
                    "200": {"description": "", "content": _json("Health")},
                    "503": {"description": "", "content": _json("Health")},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "", "content": {"text/plain": {"schema": {"type": "string"}}}}},
            }
        },
        "/flush_cache": {
            "post": {
                "summary": "Drop every cached prefix (refused with 400 while requests run or wait)",
                "responses": {"200": {"description": "", "content": _json("Status")}, **_errors("400")},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": {"description": "", "content": {"application/json": {"schema": {"type": "object"}}}}},
            }
        },
        "/v1/ws": {
            "get": {
                "summary": "WebSocket: many generations multiplexed by id (docs/websocket.md)",
                "description": "Client messages: WsGenerate, WsAbort (JSON text frames). Server messages: WsDelta, "
                "then exactly one WsDone or WsError per id.",
                "x-client-messages": [_ref("WsGenerate"), _ref("WsAbort")],
                "x-server-messages": [_ref(t.__name__) for t in WS_SERVER_MESSAGES],
                "responses": {"101": {"description": "Switching protocols"}},
            }
        },
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "Conduit", "version": "1", "description": f"Serving `{served_model}`."},
        "paths": paths,
        "components": {"schemas": components},
    }
