"""The text of a request that cache-aware routing matches on: the chat messages (role and content,
one after another) or the completion prompt. Read loosely from the raw body: the worker validates it,
so a body the gateway cannot read routes with empty text and the worker answers the error."""

from __future__ import annotations

from typing import Any

import msgspec


class _Body(msgspec.Struct):
    messages: Any = None
    prompt: Any = None


_decode = msgspec.json.Decoder(_Body).decode


def request_text(endpoint: str, body: bytes | str) -> str:
    """`endpoint` is "chat" or "completions"."""
    try:
        b = _decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    if endpoint == "chat":
        return _messages(b.messages)
    return _prompt(b.prompt)


def _messages(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append(f"{m.get('role', '')}: {_content(m.get('content'))}\n")
    return "".join(out)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\x00".join(prompt)  # batched prompts: the first one leads
        if all(isinstance(t, int) for t in prompt):
            return ",".join(map(str, prompt))  # token ids spelt out, so shared ids share a prefix
        if all(isinstance(p, list) for p in prompt):
            return "\x00".join(_prompt(p) for p in prompt)
    return ""
