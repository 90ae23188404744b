"""tool_calls and reasoning_content as the official `openai` client sees them, streaming and not, from
scripted DeepSeek outputs; what the engine request carries (tools, constraint, special tokens)."""

from __future__ import annotations

import json

import aiohttp
import openai
from http_fakes import MODEL, FakeEngine, base_url, run, serve

from runtime.http.options import ServingOptions

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MSGS = [{"role": "user", "content": "Weather in Paris and Rome?"}]
V3_OUTPUT = (
    "Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
    '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
R1_OUTPUT = "The user greets me; answer briefly.\n</think>\n\nHello! How can I help?"


def pieces(text: str, n: int = 5) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def _client(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(c), api_key="x", max_retries=0)


def test_tool_calls_non_streaming_and_streaming_agree():
    engine = FakeEngine(pieces(V3_OUTPUT))
    opts = ServingOptions(tool_call_parser="deepseekv3")

    async def go():
        async with serve(engine, opts) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking both."
            assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
                ("get_weather", {"city": "Paris"}),
                ("get_weather", {"city": "Rome"}),
            ]
            assert all(t.type == "function" and t.id.startswith("call_") for t in msg.tool_calls)
            stream = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, stream=True)
            chunks = [ch async for ch in stream]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert content == "Checking both."
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
            (0, "get_weather", {"city": "Paris"}),
            (1, "get_weather", {"city": "Rome"}),
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any("tool▁" in (ch.choices[0].delta.content or "") for ch in chunks)
        req = engine.requests[0]
        assert [t.name for t in req.tools] == ["get_weather"] and not req.params.skip_special_tokens
        assert req.params.grammar is None  # auto: parsed, not forced

    run(go())


def test_forced_tool_choice_sends_a_grammar_and_none_sends_no_tools():
    engine = FakeEngine(pieces(V3_OUTPUT))
    opts = ServingOptions(tool_call_parser="deepseekv3")

    async def go():
        async with serve(engine, opts) as c, _client(c) as oai:
            named = {"type": "function", "function": {"name": "get_weather"}}
            await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named)
            await oai.chat.completions.create(
                model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
            )
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none")
            assert r.choices[0].message.tool_calls is None and "tool▁calls" in r.choices[0].message.content
        forced, required, none = engine.requests
        fmt = json.loads(forced.params.grammar.spec)["format"]
        assert forced.params.grammar.kind == "structural_tag" and fmt["begin"] == "<｜tool▁calls▁begin｜>"
        assert fmt["content"]["begin"].endswith("<｜tool▁sep｜>get_weather\n```json\n")
        # one call, not a list of them, without parallel calls
        assert json.loads(required.params.grammar.spec)["format"]["content"]["type"] == "tag"
        assert none.tools is None and none.params.grammar is None

    run(go())


def test_reasoning_content_non_streaming_and_streaming():
    engine = FakeEngine(pieces(R1_OUTPUT, 3))
    opts = ServingOptions(reasoning_parser="deepseek-r1")

    async def go():
        async with serve(engine, opts) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS)
            msg = r.choices[0].message
            assert msg.reasoning_content == "The user greets me; answer briefly.\n"
            assert msg.content == "Hello! How can I help?" and r.choices[0].finish_reason == "stop"
            stream = await oai.chat.completions.create(model=MODEL, messages=MSGS, stream=True)
            chunks = [ch async for ch in stream]
        reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks)
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert (reasoning, content) == ("The user greets me; answer briefly.\n", "Hello! How can I help?")
        assert sum(1 for ch in chunks if getattr(ch.choices[0].delta, "reasoning_content", None)) > 3

    run(go())


def test_thinking_switch_and_effort_reach_the_template():
    engine = FakeEngine(["plain answer"])
    opts = ServingOptions(reasoning_parser="deepseek-v3")

    async def go():
        async with serve(engine, opts) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS)
            assert r.choices[0].message.content == "plain answer"  # thinking off: no reasoning split
            await oai.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                reasoning_effort="high",
                extra_body={"chat_template_kwargs": {"thinking": True}},
            )
        assert engine.requests[0].chat_template_kwargs is None
        assert engine.requests[1].chat_template_kwargs == {"thinking": True, "reasoning_effort": "high"}

    run(go())


def test_websocket_frames_carry_reasoning_and_tool_calls():
    engine = FakeEngine(pieces("Think.</think>" + V3_OUTPUT))
    opts = ServingOptions(reasoning_parser="deepseek-r1", tool_call_parser="deepseekv3")

    async def go():
        async with serve(engine, opts) as c, aiohttp.ClientSession() as s:
            async with s.ws_connect(c.make_url("/v1/ws")) as ws:
                await ws.send_json(
                    {"type": "generate", "id": "t", "request": {"messages": MSGS, "tools": TOOLS}}
                )
                frames = []
                while not frames or frames[-1]["type"] != "done":
                    frames.append(await ws.receive_json())
        deltas = frames[:-1]
        assert "".join(f.get("reasoning_content", "") for f in deltas) == "Think."
        assert "".join(f["text"] for f in deltas) == "Checking both."
        assert [tc["function"]["name"] for f in deltas for tc in f.get("tool_calls", [])] == [
            "get_weather"
        ] * 2
        assert frames[-1]["finish_reason"] == "tool_calls"

    run(go())


def test_tool_messages_and_assistant_calls_reach_the_engine():
    engine = FakeEngine(["It is sunny."])
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny, 21C"},
    ]

    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
            assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
        msgs = engine.requests[0].messages
        assert msgs[1].tool_calls[0].name == "get_weather" and msgs[1].tool_calls[0].id == "call_9"
        assert (msgs[2].role, msgs[2].tool_call_id, msgs[2].content) == ("tool", "call_9", "sunny, 21C")

    run(go())
