"""Tool-call parsers by `--tool-call-parser` name (SGLang's names), and the default for a model family."""

from __future__ import annotations

from runtime.parsers.tool_calls.base import Parsed, ParsedCall, ToolCallParser
from runtime.parsers.tool_calls.deepseek_v3 import DeepSeekV3Parser, DeepSeekV31Parser
from runtime.parsers.tool_calls.deepseek_v4 import DeepSeekV4Parser
from runtime.parsers.tool_calls.hermes import HermesParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "deepseekv4": DeepSeekV4Parser,
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
}
_BY_ARCHITECTURE = {
    "DeepseekV3ForCausalLM": "deepseekv3",
    "DeepseekV2ForCausalLM": "deepseekv3",
    "DeepseekV4ForCausalLM": "deepseekv4",
}

__all__ = ["PARSERS", "Parsed", "ParsedCall", "ToolCallParser", "get_parser", "resolve_name"]


def resolve_name(asked: str | None, architecture: str | None) -> str:
    """`--tool-call-parser`, or the model family's format (Hermes JSON for Llama and the rest)."""
    if asked is not None:
        if asked not in PARSERS:
            raise ValueError(f"--tool-call-parser {asked}: expected one of {sorted(PARSERS)}")
        return asked
    return _BY_ARCHITECTURE.get(architecture or "", "hermes")


def get_parser(name: str) -> type[ToolCallParser]:
    return PARSERS[name]
