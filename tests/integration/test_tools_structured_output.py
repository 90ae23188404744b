"""Tools and structured output with the real `openai` client on the embedded SmolLM2 (default server:
overlap scheduling on, the Hermes-style tool-call format of Llama-family models).

A 135M model knows nothing of tool calling or schemas: everything that parses below parses because the
grammar forced it, token by token, through the masks applied in the sampler."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris right now?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
}
PEOPLE = [
    "a pirate", "a chef from Lyon", "a retired astronaut", "a young violinist", "a beekeeper",
    "a marathon runner", "a librarian", "a chess champion", "a firefighter", "a painter",
    "a software engineer", "a farmer", "a nurse", "a mountain guide", "a jazz drummer",
    "a baker", "a sailor", "a teacher", "a gardener", "a detective",
]  # fmt: skip


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_a_named_tool_choice_returns_a_call_whose_arguments_follow_the_schema_streaming_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=96)
    with cf.ThreadPoolExecutor(2) as pool:  # both at once: one batch
        whole = pool.submit(client.chat.completions.create, **kw)
        streamed = pool.submit(lambda: list(client.chat.completions.create(**kw, stream=True)))
        r, chunks = whole.result(), streamed.result()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    check_call(call, WEATHER)
    assert choice.message.content is None
    # streamed: the call arrives as one tool_calls delta (index 0, its id, name and whole arguments)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0]
    assert check_call(deltas[0], WEATHER) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()


def test_required_calls_at_least_one_offered_tool(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
    )
    (call,) = r.choices[0].message.tool_calls
    check_call(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_auto_returns_content_or_calls_that_parse(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=48)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    for call in msg.tool_calls or []:
        check_call(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_tool_result_round_trip(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=24)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 40


def test_json_schema_output_validates_for_twenty_prompts(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}

    def ask(who: str) -> str:
        msgs = [{"role": "user", "content": f"Describe {who} as a JSON object with name, age and hobbies."}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=160)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    with cf.ThreadPoolExecutor(len(PEOPLE)) as pool:  # one batch: the masks of many rows per step
        answers = list(pool.map(ask, PEOPLE))
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(answers)) > 10  # twenty different prompts, not one answer


def test_json_object_regex_and_ebnf(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with the name and color of a cat."}],
        response_format={"type": "json_object"}, max_tokens=96,
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=24,
        extra_body={"regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        extra_body={"ebnf": 'root ::= "yes" | "no"'},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")


def test_a_schema_xgrammar_cannot_build_is_a_400_naming_the_field(client):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad, max_tokens=8)
    assert e.value.body["param"] == "response_format" and "nonsense" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"regex": "(unclosed"})
    assert e.value.body["param"] == "regex"


def test_the_readme_examples_answer_sensibly_every_time(client):
    """No temperature given: the embedded model's generation config (greedy) applies."""
    for _ in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
        )
        assert "Paris" in r.choices[0].message.content
    text = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": "Hi!"}]
        )
    )
    assert text.startswith("Hello")
