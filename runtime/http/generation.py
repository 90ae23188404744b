"""Running a `Job` against the engine: fan out its requests, merge their deltas, keep per-choice state.

`run_job` is an async generator of `(choice index, TextDelta)`. Closing it (aclose, or cancelling the
task that iterates it) cancels every engine stream still open, which aborts those requests in the
engine. Any engine error is raised to the consumer after the other streams are closed.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from runtime.http.engine import Engine
from runtime.http.protocol import Job
from runtime.mailbox.messages import GenerateRequest, TextDelta


async def run_job(engine: Engine, job: Job) -> AsyncIterator[tuple[int, TextDelta]]:
    reqs = job.requests
    if len(reqs) == 1:
        async with aclosing(engine.generate(reqs[0])) as stream:
            async for delta in stream:
                yield 0, delta
        return
    async for item in _merge(engine, reqs):
        yield item


async def _merge(engine: Engine, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, TextDelta]]:
    """One task per engine request, all feeding one queue; a task's end is queued after its deltas."""
    queue: asyncio.Queue[tuple[int, TextDelta | None, asyncio.Task | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        async with aclosing(engine.generate(req)) as stream:
            async for delta in stream:
                queue.put_nowait((i, delta, None))

    def on_done(i: int, task: asyncio.Task) -> None:
        queue.put_nowait((i, None, task))

    tasks = []
    for i, req in enumerate(reqs):
        task = asyncio.create_task(pump(i, req), name=f"generate-{req.rid}")
        task.add_done_callback(functools.partial(on_done, i))
        tasks.append(task)
    try:
        live = len(tasks)
        while live:
            i, delta, task = await queue.get()
            if task is None:
                yield i, delta
                continue
            live -= 1
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Choice:
    """What the response needs to remember about one choice, and its timing for metrics."""

    index: int
    start: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_offset: int = 0  # characters of completion text before the next token (completions logprobs)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def update(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def usage(choices: list[Choice], n: int) -> dict:
    """OpenAI usage: each prompt counted once (not once per sample), completions summed over choices."""
    prompt = cached = 0
    for p in range(0, len(choices), n):
        group = choices[p : p + n]
        prompt += max(c.prompt_tokens for c in group)
        cached += min(c.cached_tokens for c in group)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
