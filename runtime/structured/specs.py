"""Requests' constraints as `GrammarSpec`s. No xgrammar here: the HTTP layer builds specs and checks
their shape; the tokenizer actor checks that xgrammar accepts them (runtime/structured/grammar.py).

JSON is generated compactly (", " and ": ", no other whitespace), so a model cannot loop on blank
lines; properties the schema does not declare are never generated (xgrammar's strict mode) unless the
schema allows them explicitly. OpenAI's `strict` flag is accepted either way: the output always follows
the schema."""

from __future__ import annotations

import json
from typing import Any

from runtime.errors import InvalidRequest
from runtime.mailbox.messages import GrammarSpec

THINK_END = "</think>"


def from_response_format(rf: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's `response_format` (plus SGLang's `structural_tag` type)."""
    if not rf:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("`response_format.json_schema` must be an object.", param="response_format")
        schema = js.get("schema", js.get("schema_"))
        if schema is None:
            schema = {}  # OpenAI allows it: any JSON
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(
                "`response_format.json_schema.schema` must be a JSON schema object.",
                param="response_format.json_schema.schema",
            )
        if "strict" in js and not isinstance(js["strict"], bool | None):
            raise InvalidRequest(
                "`response_format.json_schema.strict` must be a boolean.",
                param="response_format.json_schema.strict",
            )
        return GrammarSpec(kind="json_schema", spec=json.dumps(schema))
    if kind == "structural_tag":
        fmt = rf.get("format")
        if fmt is None and "structures" in rf:
            raise InvalidRequest(
                "The legacy `structures`/`triggers` structural tag is not supported; send `format`.",
                param="response_format",
            )
        if not isinstance(fmt, dict):
            raise InvalidRequest(
                "`response_format.format` must be an object.", param="response_format.format"
            )
        return structural_tag(fmt)
    raise InvalidRequest(
        f"Unsupported `response_format` type `{kind}`; expected text, json_object, json_schema or "
        "structural_tag.",
        param="response_format.type",
    )


def from_fields(response_format: dict | None, regex: str | None, ebnf: str | None) -> GrammarSpec | None:
    """At most one constraint: `response_format`, or SGLang's `regex` / `ebnf` extensions."""
    given = [n for n, v in (("response_format", from_response_format(response_format)), ("regex", regex),
                            ("ebnf", ebnf)) if v]  # fmt: skip
    if len(given) > 1:
        raise InvalidRequest(f"Give only one of {', '.join(given)}.", param=given[1])
    if regex:
        return GrammarSpec(kind="regex", spec=regex)
    if ebnf:
        return GrammarSpec(kind="ebnf", spec=ebnf)
    return from_response_format(response_format)


def structural_tag(fmt: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": fmt}))


def as_format(spec: GrammarSpec) -> dict[str, Any]:
    """The spec as one element of a structural tag."""
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.spec), "max_whitespace_cnt": 1}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": 1}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.spec}
    if spec.kind == "ebnf":
        return {"type": "grammar", "grammar": spec.spec}
    return json.loads(spec.spec)["format"]


def after_reasoning(spec: GrammarSpec) -> GrammarSpec:
    """The constraint for a reasoning model whose output starts inside `<think>`: free text up to
    "</think>", then `spec` (the reasoning is not constrained, as in SGLang and vLLM)."""
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}
    return structural_tag({"type": "sequence", "elements": [think, as_format(spec)]})
