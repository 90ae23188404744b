"""The app as the official `openai` client sees it: stream and non-stream, usage, n, logprobs."""

from __future__ import annotations

import openai
from http_fakes import MODEL, FakeEngine, base_url, run, serve

MSGS = [{"role": "user", "content": "hi"}]


def _client(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(c), api_key="x", max_retries=0)


def test_chat_non_stream_returns_message_and_usage(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
            assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
            assert r.choices[0].message.content == "Hello world"
            assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
            u = r.usage
            assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (5, 3, 8)
            assert u.prompt_tokens_details.cached_tokens == 2
        assert engine.requests[0].params.max_tokens == 5

    run(go())


def test_chat_stream_has_role_content_finish_usage_and_done(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            stream = await oai.chat.completions.create(
                model=MODEL, messages=MSGS, stream=True, stream_options={"include_usage": True}
            )
            chunks = [ch async for ch in stream]
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "Hello world"
        finishes = [
            ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
        ]
        assert finishes == ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        assert all(ch.usage is None for ch in chunks[:-1])

    run(go())


def test_completions_stream_and_non_stream(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.completions.create(model=MODEL, prompt="hi")
            assert r.object == "text_completion" and r.choices[0].text == "Hello world"
            assert r.usage.total_tokens == 8
            stream = await oai.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True)
            chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].text for ch in chunks) == "Hello world"
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert engine.requests[1].prompt_ids == [1, 2, 3]

    run(go())


def test_n_2_merges_choices_by_index_and_counts_the_prompt_once(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS, n=2, seed=1)
            assert [ch.index for ch in r.choices] == [0, 1]
            assert all(ch.message.content == "Hello world" for ch in r.choices)
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 6)
            stream = await oai.chat.completions.create(model=MODEL, messages=MSGS, n=2, stream=True)
            texts = ["", ""]
            async for ch in stream:
                for choice in ch.choices:
                    texts[choice.index] += choice.delta.content or ""
            assert texts == ["Hello world", "Hello world"]
        assert [r.params.seed for r in engine.requests[:2]] == [1, 2]

    run(go())


def test_chat_logprobs_in_openai_format(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.chat.completions.create(model=MODEL, messages=MSGS, logprobs=True, top_logprobs=2)
            content = r.choices[0].logprobs.content
            assert [e.token for e in content] == ["Hel", "lo", " world"]
            assert content[0].logprob == -0.5 and content[0].bytes == list(b"Hel")
            assert [t.token for t in content[0].top_logprobs] == ["Hel", "token_id:7"]
            stream = await oai.chat.completions.create(model=MODEL, messages=MSGS, logprobs=True, stream=True)
            tokens = [
                e.token
                async for ch in stream
                if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content
            ]
            assert tokens == ["Hel", "lo", " world"]

    run(go())


def test_completion_logprobs_have_text_offsets(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            r = await oai.completions.create(model=MODEL, prompt="hi", logprobs=1)
            lp = r.choices[0].logprobs
            assert lp.tokens == ["Hel", "lo", " world"]
            assert lp.token_logprobs == [-0.5, -0.5, -0.5]
            assert lp.text_offset == [0, 3, 5]
            assert lp.top_logprobs[0] == {"Hel": -0.5}

    run(go())


def test_models_lists_the_served_model(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            models = await oai.models.list()
            assert [m.id for m in models.data] == [MODEL]

    run(go())


def test_openai_client_raises_typed_errors(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, _client(c) as oai:
            try:
                await oai.chat.completions.create(model="nope", messages=MSGS)
            except openai.NotFoundError as e:
                assert e.body["code"] == "model_not_found"
            else:
                raise AssertionError("expected 404")
            try:
                await oai.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "TOO LONG"}], stream=True
                )
            except openai.BadRequestError as e:
                assert "longer than the context" in e.message
            else:
                raise AssertionError("expected 400 before the stream starts")

    run(go())
