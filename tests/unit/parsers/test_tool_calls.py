"""Tool calls parsed from recorded DeepSeek-V3/R1, V3.1, V4 and Hermes-style outputs, whole and
streamed; malformed calls stay content; each format's forcing grammar accepts its own calls."""

from __future__ import annotations

import json

import pytest
from recorded import (
    HERMES_TOOL_CALLS,
    V3_TOOL_CALLS,
    V3_TOOL_CALLS_ARGS,
    V4_JSON_BODY,
    V4_TOOL_CALLS,
    V4_TOOL_CALLS_ARGS,
    V31_TOOL_CALLS,
)
from test_reasoning import chunkings

from runtime.parsers.reasoning import ReasoningParser
from runtime.parsers.tool_calls import PARSERS, Parsed, resolve_name

TOOLS = ["get_weather", "get_time"]


def streamed(name: str, pieces: list[str], tools=TOOLS, parallel: bool = True) -> Parsed:
    p = PARSERS[name](tools, parallel=parallel)
    out = Parsed()
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish()
    return out


def summary(parsed: Parsed) -> tuple[str, list[tuple[int, str, dict]]]:
    return parsed.content, [(c.index, c.name, json.loads(c.arguments)) for c in parsed.calls]


CASES = [
    (
        "deepseekv3",
        V3_TOOL_CALLS,
        "I'll check both cities for you.",
        [("get_weather", a) for a in V3_TOOL_CALLS_ARGS],
    ),
    (
        "deepseekv31",
        V31_TOOL_CALLS,
        "",
        [("get_weather", {"location": "Tokyo", "unit": "celsius"}), ("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    ("deepseekv4", V4_TOOL_CALLS, "Let me look that up.", list(zip(TOOLS, V4_TOOL_CALLS_ARGS, strict=True))),
    ("deepseekv4", V4_JSON_BODY, "", [("get_time", {"timezone": "UTC"})]),
    (
        "hermes",
        HERMES_TOOL_CALLS,
        "Sure, checking now.\n\n",
        [
            ("get_weather", {"location": "Lyon", "unit": "celsius"}),
            ("get_time", {"timezone": "Europe/Paris"}),
        ],
    ),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_recorded_calls_parse_the_same_whole_and_in_any_chunking(name, text, content, calls):
    want = (content, [(i, n, a) for i, (n, a) in enumerate(calls)])
    assert summary(PARSERS[name].parse(text, TOOLS)) == want
    for pieces in chunkings(text):
        assert summary(streamed(name, pieces)) == want


def test_call_ids_are_unique_and_openai_shaped():
    calls = PARSERS["deepseekv3"].parse(V3_TOOL_CALLS, TOOLS).calls
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].openai()["type"] == "function" and calls[0].openai()["function"]["name"] == "get_weather"


def test_content_streams_before_the_call_ends_and_no_marker_leaks():
    p = PARSERS["deepseekv3"](TOOLS)
    first = p.feed("I'll check both cities for you.<｜tool▁calls")
    assert first.content == "I'll check both cities for you." and not first.calls
    assert (
        p.feed("▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}").content == ""
    )
    done = p.feed("\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert [c.name for c in done.calls] == ["get_weather"] and done.content == ""


def test_reasoning_then_a_call_r1():
    from recorded import R1_REASONING_THEN_CALL

    reasoning, rest = ReasoningParser.split("deepseek-r1", R1_REASONING_THEN_CALL)
    assert reasoning.startswith("The user wants the weather")
    parsed = PARSERS["deepseekv3"].parse(rest, TOOLS)
    assert summary(parsed) == ("", [(0, "get_weather", {"location": "Berlin"})])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        # arguments that are not JSON
        (
            "deepseekv3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{city: Paris}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        # a function that was not offered
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        # arguments that are JSON but not an object
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),
        # a DSML parameter with a non-JSON value marked string="false"
        (
            "deepseekv4",
            '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="tz" string="false">UTC</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        ),
    ],
)
def test_a_malformed_call_is_returned_as_the_text_it_was(name, text):
    parsed = PARSERS[name].parse(text, TOOLS)
    assert not parsed.calls
    assert parsed.content.replace("<｜DSML｜tool_calls>", "").replace("</｜DSML｜tool_calls>", "").strip()


def test_a_call_cut_off_by_max_tokens_is_content():
    cut = V3_TOOL_CALLS[: V3_TOOL_CALLS.index("São")]
    parsed = PARSERS["deepseekv3"].parse(cut, TOOLS)
    assert [c.name for c in parsed.calls] == ["get_weather"]  # the first call was complete
    assert "São" not in parsed.content and parsed.content.startswith("I'll check")
    hermes_cut = PARSERS["hermes"].parse('<tool_call>\n{"name": "get_time", "argu', TOOLS)
    assert not hermes_cut.calls and hermes_cut.content == '<tool_call>\n{"name": "get_time", "argu'


def test_parallel_tool_calls_false_keeps_the_first_call():
    parsed = PARSERS["deepseekv4"].parse(V4_TOOL_CALLS, TOOLS, parallel=False)
    assert [c.name for c in parsed.calls] == ["get_weather"]


def test_text_without_calls_passes_through_untouched():
    text = "No tools needed: <tool> is not a call, nor is ``` a fence. DSML｜ appears | too."
    for name in PARSERS:
        assert summary(PARSERS[name].parse(text, TOOLS)) == (text, [])


def test_the_default_parser_follows_the_model_family():
    assert resolve_name(None, "DeepseekV3ForCausalLM") == "deepseekv3"
    assert resolve_name(None, "DeepseekV4ForCausalLM") == "deepseekv4"
    assert resolve_name(None, "LlamaForCausalLM") == "hermes"
    assert resolve_name("deepseekv31", "LlamaForCausalLM") == "deepseekv31"
    with pytest.raises(ValueError):
        resolve_name("mistral", None)
