"""OpenAI response shapes: stream chunks, full responses, logprobs, and the SSE framing.

`ChunkWriter` turns a job's merged deltas into the chunk sequence the official `openai` client
parses: for chat, a `role` chunk per choice, content chunks, `finish_reason` on each choice's last
chunk; then (with `stream_options.include_usage`) one chunk with empty `choices` and the usage.
"""

from __future__ import annotations

import msgspec

from runtime.http.chat_output import ChoiceOutput
from runtime.http.generation import Choice, usage
from runtime.http.protocol import Job
from runtime.mailbox.messages import TextDelta, TokenLogprobs

DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM uses the same floor
_encode = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _lp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def _token_texts(delta: TextDelta) -> list[str]:
    if delta.tokens_text is not None and len(delta.tokens_text) == len(delta.token_ids):
        return delta.tokens_text
    return [f"token_id:{t}" for t in delta.token_ids]


def _alt_texts(delta: TextDelta, j: int, chosen: TokenLogprobs, chosen_text: str) -> list[str]:
    """Texts of token j's top alternatives; vLLM's `token_id:<id>` spelling where none was decoded."""
    top = delta.top_tokens_text
    if top is not None and j < len(top) and len(top[j]) == len(chosen.top_ids):
        return top[j]
    return [chosen_text if t == chosen.token_id else f"token_id:{t}" for t in chosen.top_ids]


def chat_logprobs(delta: TextDelta) -> list[dict]:
    """Entries of `choices[i].logprobs.content` for the delta's tokens."""
    out = []
    for j, (text, lp) in enumerate(zip(_token_texts(delta), delta.logprobs or [], strict=False)):
        alts = _alt_texts(delta, j, lp, text)
        out.append(
            {
                "token": text,
                "logprob": _lp(lp.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": a, "logprob": _lp(tlp), "bytes": list(a.encode())}
                    for a, tlp in zip(alts, lp.top_logprobs, strict=False)
                ],
            }
        )
    return out


def completion_logprobs(delta: TextDelta, choice: Choice) -> dict:
    """`choices[i].logprobs` of /v1/completions for the delta's tokens; advances `choice.text_offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for j, (text, lp) in enumerate(zip(_token_texts(delta), delta.logprobs or [], strict=False)):
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp.logprob))
        alts = _alt_texts(delta, j, lp, text)
        top = {a: _lp(tlp) for a, tlp in zip(alts, lp.top_logprobs, strict=False)}
        if lp.token_id not in lp.top_ids:  # as OpenAI: the sampled token is listed even outside the top k
            top.setdefault(text, _lp(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(choice.text_offset)
        choice.text_offset += len(text)
    return out


class ChunkWriter:
    """Stream chunks of one job, and the per-choice state the usage chunk needs."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.choices = [Choice(i) for i in range(len(job.requests))]
        self.object = "chat.completion.chunk" if job.endpoint == "chat" else "text_completion"
        self.outputs = [ChoiceOutput(job.output) for _ in self.choices] if job.output else None

    def _chunk(self, choices: list[dict]) -> bytes:
        body = {
            "id": self.job.id,
            "object": self.object,
            "created": self.job.created,
            "model": self.job.model,
        }
        body["choices"] = choices
        if self.job.include_usage:
            body["usage"] = None
        return sse(body)

    def start(self) -> bytes:
        if self.job.endpoint != "chat":
            return b""
        return b"".join(
            self._chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in self.choices
        )

    def delta(self, index: int, delta: TextDelta) -> bytes:
        """The chunk for one delta (after `Choice.update`), or b"" when it carries nothing."""
        choice = self.choices[index]
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return b""
        logprobs = None
        if self.job.endpoint == "chat":
            if self.job.logprobs is not None:
                logprobs = {"content": chat_logprobs(delta)}
            parts, finish = {"content": delta.text} if delta.text else {}, delta.finish_reason
            if self.outputs is not None:  # reasoning and tool calls split from the text
                out = self.outputs[index]
                parts, finish = (
                    out.feed(delta.text, final=finish is not None).delta(),
                    out.finish_reason(finish),
                )
                if not parts and not logprobs and finish is None:
                    return b""
            body = {"index": index, "delta": parts, "logprobs": logprobs, "finish_reason": finish}
        else:
            if self.job.logprobs is not None:
                logprobs = completion_logprobs(delta, choice)
            body = {
                "index": index,
                "text": delta.text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
        return self._chunk([body])

    def finish(self) -> bytes:
        if not self.job.include_usage:
            return b""
        body = {
            "id": self.job.id,
            "object": self.object,
            "created": self.job.created,
            "model": self.job.model,
            "choices": [],
            "usage": usage(self.choices, self.job.n),
        }
        return sse(body)


class ResponseBuilder:
    """The non-streaming response: accumulate every delta, then `body()`."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.choices = [Choice(i) for i in range(len(job.requests))]
        self.logprobs: list[list | dict | None] = [None] * len(job.requests)
        self.outputs = [ChoiceOutput(job.output) for _ in self.choices] if job.output else None
        if job.logprobs is not None:
            for i in range(len(job.requests)):
                self.logprobs[i] = (
                    []
                    if job.endpoint == "chat"
                    else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                )

    def add(self, index: int, delta: TextDelta) -> None:
        """Record a delta's logprobs and message parts (after `Choice.update`)."""
        if self.outputs is not None:
            self.outputs[index].feed(delta.text, final=delta.finish_reason is not None)
        acc = self.logprobs[index]
        if acc is None:
            return
        if isinstance(acc, list):
            acc.extend(chat_logprobs(delta))
        else:
            for key, values in completion_logprobs(delta, self.choices[index]).items():
                acc[key].extend(values)

    def body(self) -> dict:
        job = self.job
        out = []
        for c, lps in zip(self.choices, self.logprobs, strict=True):
            text = "".join(c.text)
            if job.endpoint == "chat":
                message, finish = {"role": "assistant", "content": text}, c.finish_reason
                if self.outputs is not None:
                    message, finish = (
                        self.outputs[c.index].message(),
                        self.outputs[c.index].finish_reason(finish),
                    )
                out.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": None if lps is None else {"content": lps},
                        "finish_reason": finish,
                    }
                )
            else:
                out.append(
                    {"index": c.index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
                )
        return {
            "id": job.id,
            "object": "chat.completion" if job.endpoint == "chat" else "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": out,
            "usage": usage(self.choices, job.n),
            "system_fingerprint": None,
        }
