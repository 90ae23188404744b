"""Hermes-style JSON calls (Qwen2.5, NousHermes; the JSON format for Llama-family models here):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, text allowed around them. SGLang's `hermes` / `qwen25`."""

from __future__ import annotations

import json
from typing import Any

from runtime.mailbox.messages import FunctionTool
from runtime.parsers.tool_calls.base import ToolCallParser, calls_format, chosen, json_schema, schema_of, tag


class HermesParser(ToolCallParser):
    name = "hermes"
    section = ("<tool_call>", "</tool_call>")

    def decode(self, body: str) -> tuple[str, Any] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return obj["name"], obj.get("arguments", obj.get("parameters", {}))

    @classmethod
    def constraint(cls, tools: list[FunctionTool], forced: str | None, parallel: bool) -> dict[str, Any]:
        tags = [
            tag(
                f'<tool_call>\n{{"name": {json.dumps(t.name)}, "arguments": ',
                json_schema(schema_of(t)),
                "}\n</tool_call>",
            )
            for t in chosen(tools, forced)
        ]
        return calls_format(tags, "\n", parallel and forced is None)
