"""Structured output's specs and grammars: OpenAI's request fields become specs, xgrammar checks them,
and each tool-call format's forcing grammar accepts exactly its own well-formed calls."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from runtime.errors import InvalidRequest
from runtime.mailbox.messages import FunctionTool, GrammarSpec
from runtime.parsers.tool_calls import PARSERS
from runtime.structured import grammar, specs

WEATHER = FunctionTool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
    },
)
TIME = FunctionTool(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})
CALLS = {  # one get_weather call, as each format writes it
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseekv31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseekv4": '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
    'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
}


@pytest.fixture(scope="module")
def compiler(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    return grammar.GrammarCompiler(tokenizer, 49152, [2])


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    m = compiler.matcher(spec)
    return m._m.accept_string(text) and m.accept(2) and m.terminated


def test_response_format_becomes_a_spec():
    assert specs.from_response_format(None) is None
    assert specs.from_response_format({"type": "text"}) is None
    assert specs.from_response_format({"type": "json_object"}) == GrammarSpec(kind="json_object")
    rf = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "integer"}}}
    assert specs.from_response_format(rf) == GrammarSpec(kind="json_schema", spec='{"type": "integer"}')
    assert specs.from_fields(None, r"\d+", None) == GrammarSpec(kind="regex", spec=r"\d+")
    with pytest.raises(InvalidRequest) as e:
        specs.from_fields({"type": "json_object"}, r"\d+", None)
    assert e.value.param == "regex"


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec(kind="json_schema", spec='{"type": "nonsense"}'),
        GrammarSpec(kind="regex", spec="(unclosed"),
        GrammarSpec(kind="ebnf", spec='root ::= "a" undefined_rule'),
        GrammarSpec(kind="structural_tag", spec='{"type": "structural_tag", "format": {"type": "bogus"}}'),
    ],
)
def test_check_names_what_xgrammar_rejects(spec):
    with pytest.raises(ValueError) as e:
        grammar.check(spec)
    assert str(e.value) and "/project/" not in str(e.value)


def test_json_schema_output_is_compact_and_follows_the_schema(compiler):
    spec = GrammarSpec(kind="json_schema", spec=json.dumps(WEATHER.parameters))
    assert accepts(compiler, spec, '{"city": "Paris", "days": 2}')
    assert not accepts(compiler, spec, '{"city": "Paris"}')  # a required property missing
    assert not accepts(compiler, spec, '{"city": "Paris", "days": 0}')  # below the minimum
    assert not accepts(compiler, spec, '{\n  "city": "Paris", "days": 2}')  # no free whitespace
    assert not accepts(compiler, spec, '{"city": "Paris", "days": 2, "extra": 1}')  # undeclared property


def test_json_object_and_regex_and_ebnf(compiler):
    assert accepts(compiler, GrammarSpec(kind="json_object"), '{"a": [1, 2]}')
    assert not accepts(compiler, GrammarSpec(kind="json_object"), "[1, 2]")
    assert accepts(compiler, GrammarSpec(kind="regex", spec=r"\d{3}-\d{4}"), "555-1234")
    assert not accepts(compiler, GrammarSpec(kind="regex", spec=r"\d{3}-\d{4}"), "555-12345")
    yes_no = GrammarSpec(kind="ebnf", spec='root ::= "yes" | "no"')
    assert accepts(compiler, yes_no, "no") and not accepts(compiler, yes_no, "maybe")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_formats_forcing_grammar_accepts_its_calls_and_nothing_else(compiler, name):
    parser = PARSERS[name]
    call = CALLS[name]
    named = specs.structural_tag(parser.constraint([WEATHER, TIME], "get_weather", True))
    required = specs.structural_tag(parser.constraint([WEATHER, TIME], None, True))
    for spec in (named, required):
        grammar.check(spec)
        assert accepts(compiler, spec, call)
        assert not accepts(compiler, spec, call.replace('"days": 2', '"days": "two"').replace(">2<", ">two<"))
        assert not accepts(compiler, spec, "Sure! " + call)  # nothing before a forced call
    assert not accepts(compiler, named, call.replace("get_weather", "get_time"))
    # and what it accepts parses back into the same call
    parsed = parser.parse(call, ["get_weather", "get_time"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]


def test_reasoning_stays_free_before_a_constraint(compiler):
    spec = specs.after_reasoning(GrammarSpec(kind="regex", spec="(yes|no)"))
    assert accepts(compiler, spec, "Anything at all, even {{{ here.</think>yes")
    assert not accepts(compiler, spec, "no reasoning close yes")
