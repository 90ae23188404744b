"""One chat choice's text -> OpenAI message parts, as it streams: `reasoning_content` split off by the
reasoning parser, then `tool_calls` parsed out of the rest by the tool-call parser, the remainder being
`content`. The same object serves SSE chunks, the non-streaming message and WebSocket frames, so all
three agree.

A choice that made tool calls finishes with `finish_reason: "tool_calls"`, as OpenAI's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.http.tools import OutputSpec
from runtime.parsers.reasoning import ReasoningParser
from runtime.parsers.tool_calls import ParsedCall, ToolCallParser, get_parser


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def delta(self) -> dict[str, Any]:
        """The non-empty parts as a chat chunk's `delta`."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [{"index": c.index, **c.openai()} for c in self.calls]
        return out


class ChoiceOutput:
    def __init__(self, spec: OutputSpec) -> None:
        self.spec = spec
        self.reasoning = (
            ReasoningParser(spec.reasoning, thinking=spec.thinking) if spec.reasoning is not None else None
        )
        self.tools: ToolCallParser | None = None
        if spec.tool_parser is not None:
            self.tools = get_parser(spec.tool_parser)(list(spec.tool_names), parallel=spec.parallel)
        self.calls = 0
        # the whole message, for non-streaming answers
        self.all_reasoning: list[str] = []
        self.all_content: list[str] = []
        self.all_calls: list[ParsedCall] = []

    def feed(self, text: str, final: bool = False) -> Piece:
        """The parts `text` completes; `final` flushes what parsers hold back."""
        piece = Piece()
        if self.reasoning is not None:
            piece.reasoning, rest = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                piece.reasoning += r
                rest += c
        else:
            rest = text
        if self.tools is not None:
            parsed = self.tools.feed(rest)
            if final:
                parsed += self.tools.finish()
            piece.content, piece.calls = parsed.content, parsed.calls
        else:
            piece.content = rest
        self.calls += len(piece.calls)
        self.all_reasoning.append(piece.reasoning)
        self.all_content.append(piece.content)
        self.all_calls.extend(piece.calls)
        return piece

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> dict[str, Any]:
        """The non-streaming `choices[i].message`."""
        content = "".join(self.all_content)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(self.all_reasoning) or None
        if self.all_calls:
            msg["content"] = content.strip() or None
            msg["tool_calls"] = [c.openai() for c in self.all_calls]
        return msg
