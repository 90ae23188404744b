"""Starting the actors, and `Engine`: the offline Python API over the same actors, without HTTP.

Placements:
- "multiprocess" (default): this process runs the client, tokenizer and detokenizer; a child process runs
  the scheduler and the GPU worker, reached over a Unix socket.
- "single": everything in this process (tests, tiny deployments).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from runtime.actors import addresses, nodes
from runtime.actors.base import Actor
from runtime.actors.client import EngineClient
from runtime.actors.detokenizer import DetokenizerActor
from runtime.actors.dp_controller import DpController
from runtime.actors.engine_process import EngineArgs, dp_groups, spawn_engine_actors
from runtime.actors.system import ActorSystem
from runtime.actors.tokenizer import TokenizerActor
from runtime.config import ServerConfig
from runtime.mailbox.messages import (
    ChatMessage,
    GenerateRequest,
    NodeFailed,
    NodeReady,
    SamplingParams,
    TextDelta,
)
from runtime.model_info import ModelInfo, load_model_info, resolve_model_path

log = structlog.get_logger(__name__)

FRONTEND_ACTORS = (addresses.CLIENT, addresses.TOKENIZER, addresses.DETOKENIZER, addresses.DP_CONTROLLER)
ENGINE_START_TIMEOUT_S = 600.0


@dataclass
class Running:
    """A started engine: its actor system, the client to submit through, and the model's facts."""

    system: ActorSystem
    client: EngineClient
    info: ModelInfo

    async def stop(self) -> None:
        await _stop(self.system)


async def _stop(system: ActorSystem) -> None:
    """Stop the actors and child processes, and remove the socket directory (nothing left in /tmp)."""
    try:
        await system.stop()
    finally:
        if system.sock_dir is not None:
            shutil.rmtree(system.sock_dir, ignore_errors=True)


async def launch(cfg: ServerConfig) -> Running:
    model_path = resolve_model_path(cfg)
    info = load_model_info(cfg, model_path)
    cfg.check_parallelism()
    world_size = cfg.world_size()  # engine ranks: one is world size 1 through the same code
    if world_size > 1 and cfg.placement == "single":
        raise ValueError("many ranks run one engine process each: use --placement multiprocess")
    dp_size = dp_groups(cfg, world_size)
    if cfg.placement == "single":
        system = ActorSystem(addresses.SINGLE_NODE, {})
    else:
        placement = {a: addresses.FRONTEND_NODE for a in FRONTEND_ACTORS}
        for rank in range(world_size):
            node = addresses.engine_node(rank)
            placement |= {a: node for a in addresses.engine_actors(rank, world_size, dp_size)}
        known = nodes.node_addrs(cfg, world_size) if cfg.nnodes > 1 else {}
        sock_dir = Path(tempfile.mkdtemp(prefix="conduit-"))
        system = ActorSystem(addresses.FRONTEND_NODE, placement, sock_dir, known)
        await system.listen()
    # with DP attention the DP controller stands where the one scheduler would
    schedulers = addresses.DP_CONTROLLER if dp_size > 1 else addresses.scheduler(0)
    client = EngineClient(info.name, info.max_model_len, schedulers)
    # the tokenizer and detokenizer load their tokenizers (seconds, mostly transformers' imports) on a
    # thread while the engine processes start; nothing reaches them before the engine is ready
    text_actors = asyncio.ensure_future(
        asyncio.to_thread(lambda: (TokenizerActor(info, schedulers), DetokenizerActor(info, schedulers)))
    )
    try:
        await system.spawn(client)
        if dp_size > 1:
            await system.spawn(DpController(dp_size))

        def engine_died(msg: NodeFailed) -> None:
            client.fail_all(f"{msg.node}: {msg.error}")
            if world_size > 1:  # the survivors' collectives would wait for it: stop every rank
                system.stop_children(f"{msg.node} died")
            detokenizer = system.actors.get(addresses.DETOKENIZER)  # none yet while starting
            try:  # the detokenizer forgets the dead engine's requests (after the ones it is decoding)
                if detokenizer is not None:
                    detokenizer.mailbox.put_nowait(msg)
            except asyncio.QueueFull:
                log.warning("detokenizer_busy_at_engine_death")

        system.on_node_failed.append(engine_died)
        system.on_node_ready.append(lambda msg: client.engine_ready(msg.node))
        if cfg.placement == "single":
            await _spawn_all(system, await text_actors)
            await spawn_engine_actors(system, cfg, model_path, info.max_model_len)
        else:
            dist_addr = cfg.dist_init_addr or f"127.0.0.1:{_free_port()}"
            # a rank cannot rejoin its world alone: with many, a death stops them all, none restarts
            restarts = cfg.max_engine_restarts if world_size == 1 else 0
            here = nodes.local_ranks(cfg, world_size) if cfg.nnodes > 1 else range(world_size)
            for rank in range(world_size):
                node = addresses.engine_node(rank)
                if rank not in here:  # another machine's agent starts it; it reports here
                    system.expect(node)
                    continue
                addrs = {n: a for n, a in known.items() if n in (addresses.FRONTEND_NODE, node)}
                args = EngineArgs(
                    cfg, system.placement, str(system.sock_dir), model_path, info.max_model_len, system.node,
                    rank, world_size, dist_addr, addrs,
                )  # fmt: skip
                payload = msgspec.msgpack.encode(args)
                await system.start_child(
                    node, "runtime.actors.engine_process", payload, max_restarts=restarts
                )
            await _spawn_all(system, await text_actors)
            for rank in range(world_size):
                await system.wait_ready(addresses.engine_node(rank), ENGINE_START_TIMEOUT_S)
            if cfg.nnodes > 1:
                await _share_addresses(system, world_size)
    except BaseException:
        text_actors.cancel()
        await _stop(system)
        raise
    log.info("engine_ready", model=info.name, placement=cfg.placement, device=cfg.device, ranks=world_size)
    return Running(system, client, info)


async def _spawn_all(system: ActorSystem, actors: tuple[Actor, ...]) -> None:
    for actor in actors:
        await system.spawn(actor)


async def _share_addresses(system: ActorSystem, world_size: int) -> None:
    """Every rank learns every other rank's TCP address (schedulers reach workers of other machines)."""
    engines = [addresses.engine_node(r) for r in range(world_size)]
    for to in engines:
        for other in engines:
            if other != to:
                ready = NodeReady(other, {"addr": system.node_addrs[other]})
                await system.send_to_node(to, addresses.SYSTEM, ready)


def _free_port() -> int:
    """A free TCP port on the loopback for rank 0's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int


Prompt = str | list[int] | list[dict]


def _request(client: EngineClient, prompt: Prompt, params: SamplingParams) -> GenerateRequest:
    rid = client.new_rid("offline")
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, params=params, prompt=prompt)
    if prompt and isinstance(prompt[0], dict):
        msgs = [ChatMessage(m["role"], m["content"]) for m in prompt]
        return GenerateRequest(rid=rid, params=params, messages=msgs)
    return GenerateRequest(rid=rid, params=params, prompt_ids=list(prompt))


class Engine:
    """Offline generation: `Engine(model=..., device=...).generate(prompts, params)`.

    Prompts are text, token ids, or chat messages (a list of {"role", "content"} dicts). The actors run
    on an event loop in a background thread, so this works from plain synchronous code."""

    def __init__(self, model: str | None = None, device: str = "cpu", **config) -> None:
        self.cfg = ServerConfig(model=model, device=device, **config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="conduit-engine", daemon=True)
        self._thread.start()
        self._running: Running = self._call(launch(self.cfg))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[Output]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()

        async def run_all() -> list[Output]:
            return await asyncio.gather(*(self._collect(p, params) for p in prompts))

        return self._call(run_all())

    async def _collect(self, prompt: Prompt, params: SamplingParams) -> Output:
        text, ids, last = [], [], None
        async for d in self._running.client.generate(_request(self._running.client, prompt, params)):
            text.append(d.text)
            ids.extend(d.token_ids)
            last = d
        return Output("".join(text), ids, last.finish_reason, last.prompt_tokens, last.cached_tokens)

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[TextDelta]:
        """Async streaming from any event loop: deltas are relayed from the engine's loop."""
        queue: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()
        req = _request(self._running.client, prompt, params or SamplingParams())

        async def pump() -> None:
            try:
                async for d in self._running.client.generate(req):
                    caller.call_soon_threadsafe(queue.put_nowait, d)
            except Exception as exc:
                caller.call_soon_threadsafe(queue.put_nowait, exc)
            caller.call_soon_threadsafe(queue.put_nowait, None)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._call(self._running.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
