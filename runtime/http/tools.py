"""Chat requests' tools, tool_choice, reasoning switches and constraints -> what the engine request and
the response need.

- `tools` go to the chat template; `tool_choice` "none" keeps them out of it and parses no calls.
- "auto": the model may answer or call; calls are parsed from its text by the server's tool-call
  parser (`--tool-call-parser`).
- "required" or a named function: the output is forced by a grammar into the parser's call syntax with
  arguments that follow each function's JSON schema (runtime/parsers/tool_calls: `constraint`), so the
  arguments always parse. `parallel_tool_calls: false` allows one call.
- A reasoning answer (`--reasoning-parser deepseek-r1`, or deepseek-v3 with `thinking` on) keeps its
  reasoning free: any constraint starts after "</think>".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.errors import InvalidRequest
from runtime.mailbox.messages import FunctionTool, GrammarSpec
from runtime.parsers.tool_calls import get_parser
from runtime.structured import specs

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


ToolChoice = str | ToolChoiceFunction


@dataclass(frozen=True)
class OutputSpec:
    """How one chat answer's text becomes the message: reasoning split off, tool calls parsed out."""

    reasoning: str | None = None  # reasoning parser name
    thinking: bool = False  # the answer starts inside the reasoning
    tool_parser: str | None = None
    tool_names: tuple[str, ...] = ()
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None


def function_tools(tools: list[Tool] | None) -> list[FunctionTool]:
    out: list[FunctionTool] = []
    for i, t in enumerate(tools or []):
        if t.type != "function":
            raise InvalidRequest(
                f"Only `function` tools are supported (got `{t.type}`).", param=f"tools[{i}].type"
            )
        f = t.function
        if not _NAME.match(f.name):
            raise InvalidRequest(
                "A function name is 1-64 letters, digits, '_', '-', '.' or ':'.",
                param=f"tools[{i}].function.name",
            )
        if any(o.name == f.name for o in out):
            raise InvalidRequest(f"Two tools are named `{f.name}`.", param=f"tools[{i}].function.name")
        out.append(
            FunctionTool(
                name=f.name, description=f.description, parameters=f.parameters, strict=bool(f.strict)
            )
        )
    return out


def forced_tool(choice: ToolChoice | None, tools: list[FunctionTool]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if not tools:
        raise InvalidRequest("`tool_choice` is only allowed when `tools` are given.", param="tool_choice")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"`tool_choice` must be none, auto, required or a function (got `{choice}`).",
                param="tool_choice",
            )
        return choice, None
    name = choice.function.name
    if choice.type != "function" or all(t.name != name for t in tools):
        raise InvalidRequest(
            f"`tool_choice` names `{name}`, which is not among `tools`.", param="tool_choice"
        )
    return "named", name


def thinking_of(kwargs: dict[str, Any] | None) -> bool:
    """DeepSeek's switch (`thinking`), or Qwen's spelling of it (`enable_thinking`)."""
    kw = kwargs or {}
    return bool(kw.get("thinking", kw.get("enable_thinking", False)))


def plan_chat(
    *,
    tools: list[FunctionTool],
    tool_choice: ToolChoice | None,
    parallel: bool | None,
    constraint: GrammarSpec | None,
    tool_parser: str,
    reasoning_parser: str | None,
    template_kwargs: dict[str, Any] | None,
) -> tuple[list[FunctionTool] | None, GrammarSpec | None, OutputSpec]:
    """(tools for the template, the output's constraint, how to read the output)."""
    mode, name = forced_tool(tool_choice, tools)
    parallel = parallel is not False
    thinking = reasoning_parser == "deepseek-r1" or (
        reasoning_parser is not None and thinking_of(template_kwargs)
    )
    if mode in ("required", "named"):
        if constraint is not None:
            raise InvalidRequest(
                "A forced `tool_choice` cannot be combined with `response_format`, `regex` or `ebnf`.",
                param="tool_choice",
            )
        fmt = get_parser(tool_parser).constraint(tools, name, parallel)
        constraint = specs.structural_tag(fmt)
    if constraint is not None and thinking:
        constraint = specs.after_reasoning(constraint)
    out = OutputSpec(
        reasoning=reasoning_parser,
        thinking=thinking,
        tool_parser=tool_parser if mode != "none" else None,
        tool_names=tuple(t.name for t in tools) if mode != "named" else (name,),
        parallel=parallel,
    )
    return (tools or None) if mode != "none" else None, constraint, out
