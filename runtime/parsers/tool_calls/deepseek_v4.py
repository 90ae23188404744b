"""DeepSeek-V4 calls (`deepseekv4`): a DSML block after the answer's text, one `invoke` per call whose
parameters are strings as written (`string="true"`) or JSON values (`string="false"`):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The release's encoder writes "\\n\\n" before the block (not content). An invoke whose body is a JSON
object instead of parameters is accepted too, as SGLang's parser does."""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.mailbox.messages import FunctionTool
from runtime.parsers.tool_calls.base import ToolCallParser, calls_format, chosen, json_schema, schema_of, tag

DSML = "｜DSML｜"
BLOCK_BEGIN, BLOCK_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_BEGIN, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
_NAME = re.compile(r'^\s*name="(?P<name>[^"]+)"\s*>\s*(?P<body>.*?)\s*$', re.S)
_PARAM = re.compile(
    rf'<{DSML}parameter name="(?P<key>[^"]+)" string="(?P<string>true|false)">(?P<value>.*?)</{DSML}parameter>',
    re.S,
)


class DeepSeekV4Parser(ToolCallParser):
    name = "deepseekv4"
    section = (BLOCK_BEGIN, BLOCK_END)
    call = (INVOKE_BEGIN, INVOKE_END)
    lead = "\n"

    def decode(self, body: str) -> tuple[str, Any] | None:
        m = _NAME.match(body)
        if m is None:
            return None
        inner = m["body"]
        if inner.startswith("{"):
            try:
                return m["name"], json.loads(inner)
            except ValueError:
                return None
        args: dict[str, Any] = {}
        end = 0
        for p in _PARAM.finditer(inner):
            if inner[end : p.start()].strip() or p["key"] in args:
                return None  # text between parameters, or a repeated one: not a well-formed call
            end = p.end()
            if p["string"] == "true":
                args[p["key"]] = p["value"]
            else:
                try:
                    args[p["key"]] = json.loads(p["value"])
                except ValueError:
                    return None
        if inner[end:].strip():
            return None
        return m["name"], args

    @classmethod
    def constraint(cls, tools: list[FunctionTool], forced: str | None, parallel: bool) -> dict[str, Any]:
        tags = [
            tag(
                f'{INVOKE_BEGIN} name="{t.name}">\n',
                json_schema(schema_of(t), "deepseek_xml"),
                f"{INVOKE_END}\n",
            )
            for t in chosen(tools, forced)
        ]
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"\n\n{BLOCK_BEGIN}\n"},
                calls_format(tags, "", parallel and forced is None),
                {"type": "const_string", "value": BLOCK_END},
            ],
        }
