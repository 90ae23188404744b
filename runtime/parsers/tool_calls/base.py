"""The tool-call parser contract, and the streaming machine every format shares.

A format names its markers and how one call's text decodes:

    section = (start, end)    the block that holds the calls ("<｜tool▁calls▁begin｜>" ...), or, when
                              `call` is None, one call each ("<tool_call>" ... "</tool_call>")
    call = (start, end)       one call inside a section, or None
    decode(body)              a call's text between its markers -> (name, arguments object), or None

and how its calls are forced (`constraint`: an xgrammar structural tag for tool_choice `required` or a
named function; the grammar guarantees the format and the arguments' JSON schema).

`feed(text)` returns what a piece of output completes: content text, and each tool call once its end
marker arrives (one delta per call, its arguments whole: a call is only sent once it parsed and names a
known function, so streaming and non-streaming agree). Text that could be the start of a marker is held
back. A call that does not decode, names an unknown function, or has arguments that are not a JSON
object is returned as content, as it was written. `finish()` flushes: an unterminated call is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from runtime.mailbox.messages import FunctionTool
from runtime.parsers.streaming import partial_suffix


@dataclass(frozen=True)
class ParsedCall:
    index: int  # position among this answer's calls
    id: str
    name: str
    arguments: str  # JSON text of an object

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_args(value: Any) -> str | None:
    """Arguments as OpenAI sends them (JSON text of an object), or None if `value` is not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class ToolCallParser:
    name: ClassVar[str]
    section: ClassVar[tuple[str, str]]
    call: ClassVar[tuple[str, str] | None] = None
    lead: ClassVar[str] = ""  # whitespace the format writes before a section: not content

    def __init__(self, tools: list[str], *, parallel: bool = True) -> None:
        self.tools = set(tools)
        self.parallel = parallel
        self.buf = ""
        self.in_section = False
        self.count = 0

    # ------------------------------------------------------------------ the format

    def decode(self, body: str) -> tuple[str, Any] | None:
        raise NotImplementedError

    @classmethod
    def constraint(cls, tools: list[FunctionTool], forced: str | None, parallel: bool) -> dict[str, Any]:
        """The structural-tag format that forces calls: of `forced` only (a named tool_choice), else at
        least one of `tools` (`required`); one call at most unless `parallel`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ streaming

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            step = self._section() if self.in_section else self._text()
            if step is None:
                return out
            out += step

    def finish(self) -> Parsed:
        """The output ended: anything held back (an unterminated call or section) is content."""
        out = Parsed(content=(self.section[0] if self.in_section else "") + self.buf)
        self.buf = ""
        self.in_section = False
        return out

    def _text(self) -> Parsed | None:
        start = self.section[0]
        pos = self.buf.find(start)
        if pos < 0:
            text = self.buf[: len(self.buf) - partial_suffix(self.buf, start)]
            if self.lead:  # whitespace before what may become a section is held back too
                text = text.rstrip(self.lead)
            self.buf = self.buf[len(text) :]
            return Parsed(content=text) if text else None
        text = self.buf[:pos]
        if self.lead:
            text = text.rstrip(self.lead)
        self.buf = self.buf[pos + len(start) :]
        self.in_section = True
        return Parsed(content=text)

    def _section(self) -> Parsed | None:
        end = self.section[1]
        if self.call is None:  # the section is one call
            pos = self.buf.find(end)
            if pos < 0:
                return None
            body, raw = self.buf[:pos], self.section[0] + self.buf[: pos + len(end)]
            self.buf = self.buf[pos + len(end) :]
            self.in_section = False
            return self._emit(body, raw)
        call_start, call_end = self.call
        next_call, close = self.buf.find(call_start), self.buf.find(end)
        if close >= 0 and (next_call < 0 or close < next_call):
            between = self.buf[:close]
            self.buf = self.buf[close + len(end) :]
            self.in_section = False
            return Parsed(content=between.strip())  # separators; anything else stays visible
        if next_call < 0:
            return None
        stop = self.buf.find(call_end, next_call + len(call_start))
        if stop < 0:
            return None
        body = self.buf[next_call + len(call_start) : stop]
        raw = self.buf[next_call : stop + len(call_end)]
        skipped = self.buf[:next_call].strip()
        self.buf = self.buf[stop + len(call_end) :]
        out = self._emit(body, raw)
        out.content = skipped + out.content
        return out

    def _emit(self, body: str, raw: str) -> Parsed:
        decoded = self.decode(body)
        if decoded is None or decoded[0] not in self.tools:
            return Parsed(content=raw)
        args = json_args(decoded[1])
        if args is None:
            return Parsed(content=raw)
        if self.count and not self.parallel:
            return Parsed()  # parallel_tool_calls false: the first call only
        call = ParsedCall(self.count, new_call_id(), decoded[0], args)
        self.count += 1
        return Parsed(calls=[call])

    @classmethod
    def parse(cls, text: str, tools: list[str], *, parallel: bool = True) -> Parsed:
        """The whole output at once."""
        p = cls(tools, parallel=parallel)
        out = p.feed(text)
        out += p.finish()
        return out


# ---------------------------------------------------------------------- structural-tag pieces


def schema_of(tool: FunctionTool) -> dict[str, Any] | bool:
    """A tool's argument schema for the grammar: any JSON object when it has none."""
    return tool.parameters if tool.parameters is not None else {"type": "object"}


def tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


# Whitespace a forced call's JSON may put between tokens: one space or newline, so a model cannot loop
# on blank lines (structural tags have no strictly compact JSON style).
MAX_WHITESPACE = 1


def json_schema(schema: Any, style: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    if style is not None:
        out["style"] = style
    return out


def calls_format(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """One or more of `tags` (exactly one unless `parallel`)."""
    if len(tags) == 1 and not parallel:
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def chosen(tools: list[FunctionTool], forced: str | None) -> list[FunctionTool]:
    picked = [t for t in tools if forced is None or t.name == forced]
    if not picked:
        raise ValueError(f"no tool named {forced!r}")
    return picked
