from __future__ import annotations

import json

import pytest

from runtime.errors import InvalidRequest, NotFound
from runtime.http.protocol import parse_chat, parse_completion

MODEL = "m"


def chat(**kw) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return json.dumps(body).encode()


def completion(**kw) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **kw}).encode()


def test_chat_builds_one_request_with_openai_defaults():
    job = parse_chat(chat(), served_model=MODEL)
    (req,) = job.requests
    assert job.id.startswith("chatcmpl-") and req.rid == job.id
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"
    p = req.params
    assert (p.temperature, p.top_p, p.max_tokens, p.logprobs, p.top_k) == (1.0, 1.0, None, None, -1)


def test_chat_maps_every_sampling_field():
    job = parse_chat(
        chat(
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            stop="END",
            seed=3,
            presence_penalty=1,
            frequency_penalty=-1,
            ignore_eos=True,
            min_tokens=2,
            stop_token_ids=[9],
            top_k=20,
            min_p=0.1,
            repetition_penalty=1.2,
            skip_special_tokens=False,
            priority=4,
            logprobs=True,
            top_logprobs=3,
        ),
        served_model=MODEL,
    )
    req = job.requests[0]
    p = req.params
    assert p.max_tokens == 7 and p.greedy and p.top_p == 0.5 and p.stop == ["END"] and p.seed == 3
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens, p.stop_token_ids) == (1, -1, 2, [9])
    assert (p.top_k, p.min_p, p.repetition_penalty, p.logprobs) == (20, 0.1, 1.2, 3)
    assert p.ignore_eos and not p.skip_special_tokens and req.priority == 4


def test_chat_content_parts_are_joined_and_developer_is_a_system_message():
    body = json.dumps(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        }
    ).encode()
    msgs = parse_chat(body, served_model=MODEL).requests[0].messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "a\nb")]


def test_n_fans_out_with_suffixed_rids_and_shifted_seeds():
    job = parse_chat(chat(n=3, seed=10), served_model=MODEL)
    assert [r.rid for r in job.requests] == [f"{job.id}-{i}" for i in range(3)]
    assert [r.params.seed for r in job.requests] == [10, 11, 12]


def test_completion_prompt_forms():
    assert parse_completion(completion(), served_model=MODEL).requests[0].prompt == "hi"
    assert parse_completion(completion(prompt=["x"]), served_model=MODEL).requests[0].prompt == "x"
    assert parse_completion(completion(prompt=[1, 2]), served_model=MODEL).requests[0].prompt_ids == [1, 2]
    job = parse_completion(completion(prompt=[[1], [2, 3]], n=2), served_model=MODEL)
    assert [r.prompt_ids for r in job.requests] == [[1], [1], [2, 3], [2, 3]]
    assert job.requests[0].params.max_tokens == 16  # OpenAI's completions default


def test_missing_model_is_accepted_and_unknown_model_is_404():
    parse_chat(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), served_model=MODEL)
    with pytest.raises(NotFound) as e:
        parse_chat(chat(model="gpt-4"), served_model=MODEL)
    assert e.value.code == "model_not_found" and e.value.param == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[]", None),
        (json.dumps({"model": MODEL}).encode(), "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0]"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(max_tokens=10**6), "max_tokens"),
        (chat(temperature=2.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(n=0), "n"),
        (chat(n=17), "n"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(stop=5), "stop"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(min_tokens=5, max_tokens=2), "min_tokens"),
        (chat(tools=[{"type": "function"}]), "tools[0].function"),
        (chat(tools=[{"type": "code", "function": {"name": "f"}}]), "tools[0].type"),
        (chat(tool_choice="required"), "tool_choice"),
        (
            chat(
                tools=[{"function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice",
        ),
        (chat(reasoning_effort="extreme"), "reasoning_effort"),
        (chat(regex="a+", ebnf='root ::= "a"'), "ebnf"),
        (chat(logit_bias={"5": 1.0}), "logit_bias"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(response_format={"type": "json_schema"}), "response_format"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body, served_model=MODEL, max_model_len=4096)
    assert e.value.param == param, e.value.message
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(prompt=[]), "prompt"),
        (completion(prompt=[1, "a"]), "prompt"),
        (completion(prompt=[[]]), "prompt[0]"),
        (completion(prompt=[-1]), "prompt"),
        (completion(prompt=None), "prompt"),
        (completion(logprobs=21), "logprobs"),
        (completion(echo=True), "echo"),
        (completion(prompt=["a"] * 20, n=16), "n"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_completion(body, served_model=MODEL)
    assert e.value.param == param, e.value.message
