"""Fuzzing the serving fields against a real server: `tools`, `tool_choice`, `response_format`, `regex`,
`ebnf` and the API key. Hypothesis builds bodies that mix valid shapes (real JSON schemas, tool lists)
with broken ones (wrong types, schemas xgrammar rejects, unbalanced regexes, grammars that do not
parse, keys of the wrong length or encoding); they go out in concurrent batches. Not one answer may be a
5xx, every 4xx must be an OpenAI error body, every 2xx a completion; afterwards the server still
answers a normal request, and every KV page is back. The counts are printed.

The schema fuzz (test_schema_fuzz.py) reaches these fields too, but only with random JSON; the
strategies here aim at what the grammar compiler and the tool-call parser actually see."""

from __future__ import annotations

import asyncio
import collections
import json

import aiohttp
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.http import openapi

KEY = "sk-conduit-fuzz-0123456789"
BATCH = 16
BODIES = 480
KEYS = 600
TIMEOUT = aiohttp.ClientTimeout(total=180)

_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_leaf_types = st.sampled_from(["string", "integer", "number", "boolean", "null"])


def _schemas() -> st.SearchStrategy:
    """JSON schemas: small valid ones (bounded so a constrained answer ends in the token budget) and
    things that are not schemas at all."""
    leaf = st.builds(lambda t: {"type": t}, _leaf_types) | st.builds(
        lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)
    )
    valid = st.recursive(
        leaf,
        lambda inner: (
            st.builds(
                lambda props, req: {
                    "type": "object",
                    "properties": props,
                    "required": [k for k in props if req],
                },
                st.dictionaries(_names, inner, max_size=3),
                st.booleans(),
            )
            | st.builds(
                lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 2)
            )
        ),
        max_leaves=4,
    )
    broken = st.one_of(
        st.builds(lambda t: {"type": t}, st.text(max_size=8)),
        st.just({"type": "object", "properties": 7}),
        st.just({"$ref": "#/definitions/missing"}),
        st.just({"type": "string", "pattern": "(unclosed"}),
        st.just({"type": "integer", "minimum": 5, "maximum": 1}),
        st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=3),
        st.integers(),
        st.text(max_size=10),
        st.none(),
    )
    return valid | broken


def _response_formats() -> st.SearchStrategy:
    json_schema = st.builds(
        lambda name, schema, strict: {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": strict},
        },
        _names,
        _schemas(),
        st.booleans(),
    )
    return st.one_of(
        json_schema,
        st.just({"type": "json_object"}),
        st.just({"type": "text"}),
        st.builds(lambda t: {"type": t}, st.text(max_size=12)),
        st.just({"type": "json_schema"}),
        st.just({"type": "json_schema", "json_schema": "not an object"}),
        st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
    )


def _tools() -> st.SearchStrategy:
    function = st.builds(
        lambda name, params, desc: {
            "type": "function",
            "function": {"name": name, "parameters": params, **({"description": desc} if desc else {})},
        },
        _names | st.text(max_size=10),
        _schemas(),
        st.none() | st.text(max_size=20),
    )
    broken = st.one_of(
        st.just({"type": "function"}),
        st.just({"type": "retrieval", "function": {"name": "x"}}),
        st.builds(lambda x: {"type": "function", "function": x}, st.integers() | st.text(max_size=5)),
        st.text(max_size=5),
    )
    return st.lists(function | broken, min_size=0, max_size=3)


def _tool_choices() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from(["auto", "none", "required", "sometimes", ""]),
        st.builds(lambda n: {"type": "function", "function": {"name": n}}, _names),
        st.just({"type": "function"}),
        st.integers(),
    )


# the regexes xgrammar must compile or refuse: valid small ones and broken ones
_REGEXES = st.one_of(
    st.sampled_from([r"[a-z]{1,4}", r"(yes|no)", r"\d{1,3}", r"[A-Z][a-z]{0,3}!", r"a*b?", ".{0,3}"]),
    st.sampled_from([r"(", r"[a-", r"a{3,1}", r"\\", r"(?P<x", r"*a", ""]),
    st.text(max_size=12),
)
_EBNFS = st.one_of(
    st.sampled_from(['root ::= "yes" | "no"', 'root ::= [a-c]+ "."', 'root ::= item\nitem ::= "x" item?']),
    st.sampled_from(["root ::=", "root ::= undefined_rule", 'root = "x"', "::=", ""]),
    st.text(max_size=20),
)


def _bodies() -> st.SearchStrategy:
    """Chat bodies carrying zero or more of the fields at once."""
    field = st.fixed_dictionaries(
        {},
        optional={
            "tools": _tools(),
            "tool_choice": _tool_choices(),
            "response_format": _response_formats(),
            "regex": _REGEXES,
            "ebnf": _EBNFS,
            "parallel_tool_calls": st.booleans() | st.integers(),
        },
    )
    return st.builds(
        lambda extra, stream: {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": stream,
            **extra,
        },
        field,
        st.booleans(),
    )


def _keys() -> st.SearchStrategy:
    near = st.builds(lambda i, c: KEY[:i] + c + KEY[i + 1 :], st.integers(0, len(KEY) - 1), st.characters())
    return st.one_of(
        st.text(max_size=40),
        near,
        st.just(KEY + " "),
        st.just(KEY.upper()),
        st.just(KEY[:-1]),
        st.binary(max_size=24).map(lambda b: b.decode("latin-1")),
    )


def _check(status: int, content_type: str, body: bytes) -> str | None:
    """Why an answer breaks the contract, or None."""
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if content_type == "text/event-stream":
        events = [ln[6:] for ln in body.decode().splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream without [DONE]"
        for e in events[:-1]:
            event = json.loads(e)
            msgspec.convert(event, openapi.ErrorResponse if "error" in event else openapi.ChatCompletionChunk)
        return None
    model = openapi.ChatCompletion if status < 300 else openapi.ErrorResponse
    try:
        msgspec.json.decode(body, type=model)
    except msgspec.ValidationError as e:
        return f"{status} does not match {model.__name__}: {e}: {body[:300]!r}"
    return None


def _draw(strategy: st.SearchStrategy, n: int) -> list:
    """n examples of a strategy, drawn through hypothesis (deterministic: derandomized)."""
    drawn: list = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(x) -> None:
        drawn.append(x)

    collect()
    return drawn


async def _post_all(url: str, bodies: list[dict], headers_of) -> tuple[collections.Counter, list[str]]:
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

        async def one(i: int, body: dict) -> None:
            try:
                async with session.post(url, json=body, headers=headers_of(i)) as r:
                    raw = await r.read()
                    statuses[r.status] += 1
                    if why := _check(r.status, r.content_type, raw):
                        problems.append(f"{json.dumps(body)[:400]}: {why}")
            except (TimeoutError, aiohttp.ClientError) as e:
                problems.append(f"{json.dumps(body)[:400]}: {type(e).__name__}: {e}")

        for start in range(0, len(bodies), BATCH):
            await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies[start : start + BATCH], start)))
    return statuses, problems


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory, server_runner):
    with server_runner(tmp_path_factory.mktemp("fuzz-fields"), "--api-key", KEY) as s:
        yield s


def _ok_after(srv) -> None:
    import urllib.request

    req = urllib.request.Request(
        f"{srv.url}/v1/chat/completions",
        data=json.dumps(
            {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        assert json.loads(r.read())["choices"][0]["message"]["content"]


def test_fuzzed_tools_and_structured_output_fields_never_5xx(srv):
    bodies = _draw(_bodies(), BODIES)
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses, problems = asyncio.run(_post_all(f"{srv.url}/v1/chat/completions", bodies, lambda i: headers))
    print(
        f"\nfuzzed serving fields: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}"
    )
    assert not problems, "\n".join(problems[:10])
    assert sum(statuses.values()) == len(bodies)
    # both outcomes were exercised: constrained requests that ran and refused ones
    assert statuses[200] > 20 and statuses[400] > 20, statuses
    _ok_after(srv)
    srv.wait_idle(api_key=KEY)


def test_fuzzed_api_keys_are_refused_with_401_and_the_right_key_still_works(srv):
    keys = _draw(_keys(), KEYS)
    keys = [k for k in keys if k != KEY]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def headers_of(i: int) -> dict[str, str]:
        # the key in the three places a client may put it, and as a bare value without the scheme
        # (headers are latin-1 without control characters, or the client itself refuses to send them)
        k = "".join(
            c for c in keys[i].encode("latin-1", "replace").decode("latin-1") if c >= " " and c != "\x7f"
        )
        return [
            {"Authorization": f"Bearer {k}"},
            {"Authorization": k},
            {"X-API-Key": k},
            {"Authorization": f"Basic {k}"},
        ][i % 4]

    statuses, problems = asyncio.run(
        _post_all(f"{srv.url}/v1/chat/completions", [body] * len(keys), headers_of)
    )
    print(f"\nfuzzed API keys: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:10])
    assert set(statuses) == {401}, statuses
    _ok_after(srv)
    srv.wait_idle(api_key=KEY)
