"""DeepSeek-V3 / R1 calls (`deepseekv3`) and DeepSeek-V3.1's variant (`deepseekv31`):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the code fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>`, calls back to back."""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.mailbox.messages import FunctionTool
from runtime.parsers.tool_calls.base import ToolCallParser, calls_format, chosen, json_schema, schema_of, tag

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3_CALL = re.compile(
    r"\s*\w*" + SEP + r"(?P<name>[^\n]+?)\s*\n```(?:json)?\s*\n?(?P<args>.*?)\s*```\s*$", re.S
)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseekv3"
    section = (CALLS_BEGIN, CALLS_END)
    call = (CALL_BEGIN, CALL_END)

    def decode(self, body: str) -> tuple[str, Any] | None:
        m = _V3_CALL.match(body)
        if m is None:
            return None
        args = _loads(m["args"])
        return (m["name"], args) if args is not None else None

    @classmethod
    def _tag(cls, tool: FunctionTool) -> tuple[str, dict[str, Any], str]:
        return (
            f"{CALL_BEGIN}function{SEP}{tool.name}\n```json\n",
            json_schema(schema_of(tool)),
            f"\n```{CALL_END}",
        )

    @classmethod
    def constraint(cls, tools: list[FunctionTool], forced: str | None, parallel: bool) -> dict[str, Any]:
        tags = [tag(*cls._tag(t)) for t in chosen(tools, forced)]
        separator = "\n" if cls.name == "deepseekv3" else ""
        return tag(CALLS_BEGIN, calls_format(tags, separator, parallel and forced is None), CALLS_END)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseekv31"

    def decode(self, body: str) -> tuple[str, Any] | None:
        name, sep, args = body.partition(SEP)
        if not sep or not name.strip():
            return None
        value = _loads(args)
        return (name.strip(), value) if value is not None else None

    @classmethod
    def _tag(cls, tool: FunctionTool) -> tuple[str, dict[str, Any], str]:
        return f"{CALL_BEGIN}{tool.name}{SEP}", json_schema(schema_of(tool)), CALL_END
