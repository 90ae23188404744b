"""Supervision in the actor system, and the tokenizer's ordering guarantee off the event loop: an actor that
crashes fails what it held and is replaced by a fresh instance that keeps its mailbox; an abort that
arrives while its request is being tokenized drops the request, and one that arrives after it was sent
follows it to the scheduler."""

from __future__ import annotations

import asyncio

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.actors.system import ActorSystem
from runtime.actors.tokenizer import TokenizerActor
from runtime.config import ServerConfig
from runtime.mailbox.messages import (
    AbortRequest,
    GenerateRequest,
    Message,
    RequestFailed,
    SamplingParams,
    TokenizedRequest,
    TrackRequest,
)
from runtime.model_info import load_model_info


class Sink(Actor):
    """Records what reaches an address."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.got: list[Message] = []
        self.arrived = asyncio.Event()

    async def handle(self, msg: Message) -> None:
        self.got.append(msg)
        self.arrived.set()


class Fragile(Actor):
    """Holds the rids it saw; crashes on the rid "boom"."""

    restart_on_crash = True
    instances: list[Fragile] = []

    def __init__(self) -> None:
        super().__init__("fragile")
        self.held: list[str] = []
        Fragile.instances.append(self)

    def fresh(self) -> Fragile:
        return Fragile()

    async def on_crash(self, msg: Message, exc: BaseException) -> None:
        await self.fail(self.held, f"fragile failed: {exc}")

    async def handle(self, msg: Message) -> None:
        assert isinstance(msg, AbortRequest)
        if msg.rid == "boom":
            raise RuntimeError("boom")
        self.held.append(msg.rid)


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)  # polling state the actors own; there is no event for "all handled"


def test_a_crashed_actor_fails_what_it_held_and_a_fresh_one_keeps_its_mailbox():
    async def main():
        system = ActorSystem(addresses.SINGLE_NODE, {})
        client = await system.spawn(Sink(addresses.CLIENT))
        Fragile.instances.clear()
        fragile = await system.spawn(Fragile())
        for rid in ("a", "b", "boom", "c"):  # queued together: "c" waits behind the crash
            fragile.mailbox.put_nowait(AbortRequest(rid))
        await _until(lambda: len(Fragile.instances) == 2 and Fragile.instances[1].held == ["c"])
        await system.stop()
        return client.got

    got = asyncio.run(main())
    assert [(m.rid, m.status) for m in got if isinstance(m, RequestFailed)] == [("a", 500), ("b", 500)]
    assert "boom" in got[0].message


def test_tokenizer_drops_a_request_aborted_while_tokenized_and_keeps_later_aborts_in_order(smollm2_path):
    async def main():
        system = ActorSystem(addresses.SINGLE_NODE, {})
        scheduler = await system.spawn(Sink(addresses.scheduler(0)))
        detokenizer = await system.spawn(Sink(addresses.DETOKENIZER))
        await system.spawn(Sink(addresses.CLIENT))
        info = load_model_info(ServerConfig(), str(smollm2_path))
        tokenizer = await system.spawn(TokenizerActor(info))
        params = SamplingParams(max_tokens=4)
        # "early" is aborted right behind it: both reach the actor before its tokenization ends
        tokenizer.mailbox.put_nowait(GenerateRequest(rid="early", params=params, prompt="x " * 50_000))
        tokenizer.mailbox.put_nowait(AbortRequest("early"))
        tokenizer.mailbox.put_nowait(GenerateRequest(rid="late", params=params, prompt="hello"))
        await _until(lambda: any(isinstance(m, TokenizedRequest) for m in scheduler.got))
        await tokenizer.mailbox.put(AbortRequest("late"))
        await _until(lambda: len(scheduler.got) == 2)
        await _until(lambda: not tokenizer._pending)
        await system.stop()
        return scheduler.got, detokenizer.got

    got, tracked = asyncio.run(main())
    assert [(type(m).__name__, m.rid) for m in got] == [
        ("TokenizedRequest", "late"),
        ("AbortRequest", "late"),
    ]
    assert [m.rid for m in tracked if isinstance(m, TrackRequest)] == ["late"]
