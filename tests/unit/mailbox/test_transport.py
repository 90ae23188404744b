import asyncio

import msgspec
import pytest

from runtime.actors.base import Actor
from runtime.actors.system import ActorSystem
from runtime.mailbox import transport
from runtime.mailbox.mailbox import Mailbox
from runtime.mailbox.messages import Envelope, SamplingParams, StepPlan, TokenBatch, TokenizedRequest


def test_messages_round_trip_through_msgpack_frames():
    plan = StepPlan(
        3,
        [],
        [2],
        [1, 2],
        [0, 5],
        [5, 1],
        [False, True],
        [1, 2, 3, 4, 5],
        [9, 10, 11, 12, 13, 14],
        [True, True],
    )
    req = TokenizedRequest(
        rid="x", input_ids=[1, 2], params=SamplingParams(stop=["\n"], top_k=5), stop_ids=[0], max_new_tokens=4
    )
    for msg in (plan, req):
        frame = transport.encode(Envelope("worker", msg))
        decoded = msgspec.msgpack.decode(frame[4:], type=Envelope)
        assert decoded.msg == msg


class Recorder(Actor):
    def __init__(self, expected: int) -> None:
        super().__init__("recorder")
        self.seen: list = []
        self.done = asyncio.Event()
        self.expected = expected

    async def handle(self, msg) -> None:
        self.seen.append(msg)
        if len(self.seen) == self.expected:
            self.done.set()


def test_cross_process_delivery_is_fifo_per_sender(tmp_path):
    async def main():
        a = ActorSystem("a", {"recorder": "b"}, tmp_path)
        b = ActorSystem("b", {"recorder": "b"}, tmp_path)
        await b.listen()
        rec = await b.spawn(Recorder(200))
        for i in range(200):
            batch = TokenBatch([f"r{i}"], [[i]], [None], [1], [1], [0], [None])
            await a.send("recorder", batch)
        await asyncio.wait_for(rec.done.wait(), 10)
        assert [m.rids[0] for m in rec.seen] == [f"r{i}" for i in range(200)]
        await a.stop()
        await b.stop()

    asyncio.run(main())


def test_mailbox_is_bounded():
    async def main():
        box = Mailbox(2)
        box.put_nowait(1)
        box.put_nowait(2)
        with pytest.raises(asyncio.QueueFull):
            box.put_nowait(3)
        assert await box.get() == 1

    asyncio.run(main())
