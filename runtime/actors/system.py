"""The actor system of one process: runs local actors, routes messages to local mailboxes or to other
processes, and watches child processes (supervision).

Addresses are rank-aware actor names ("tokenizer", "scheduler/dp0", "worker/0", ...: runtime/actors/
addresses.py). A placement maps each address to the node (process) that runs it; a message to an actor
of another node is framed over that node's Unix socket (runtime/mailbox/transport.py). The pseudo-actor
"system" of each node receives node lifecycle messages (NodeReady, NodeFailed).

Supervision: an actor that declares `restart_on_crash` (tokenizer, detokenizer) is replaced by a fresh
instance when its `handle` raises, after `on_crash` failed the requests it held; other actors keep running
and fail only the message's request (`Actor.on_error`). A child process that dies is reported to
`on_node_failed` subscribers, messages to it are dropped while it is down, and it is started again (with
a back-off, at most `max_restarts` times in `RESTART_WINDOW_S`); its NodeReady reaches `on_node_ready`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import structlog

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.mailbox import transport
from runtime.mailbox.messages import Envelope, Message, NodeFailed, NodeReady, Shutdown

log = structlog.get_logger(__name__)

RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S = (0.5, 2.0, 5.0, 10.0)


class ActorSystem:
    def __init__(
        self,
        node: str,
        placement: dict[str, str],
        sock_dir: Path | None = None,
        node_addrs: dict[str, str] | None = None,
    ) -> None:
        self.node = node
        self.placement = placement  # actor address -> node name
        self.sock_dir = sock_dir
        # nodes reached over TCP (`tcp://HOST:PORT`: other hosts); the rest by Unix socket in sock_dir.
        # A NodeReady that carries an "addr" adds its node.
        self.node_addrs = dict(node_addrs or {})
        self.actors: dict[str, Actor] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._links: dict[str, transport.Link] = {}
        self._link_locks: dict[str, asyncio.Lock] = {}
        self._server: asyncio.AbstractServer | None = None
        self._children: dict[str, asyncio.subprocess.Process] = {}
        self.ready: dict[str, asyncio.Future[NodeReady]] = {}
        self.on_node_failed: list[Callable[[NodeFailed], None]] = []
        self.on_node_ready: list[Callable[[NodeReady], None]] = []
        self._child_specs: dict[str, tuple[str, bytes, int]] = {}  # node -> (module, payload, max restarts)
        self._restarts: dict[str, deque[float]] = {}  # node -> times of its recent restarts
        self._down: set[str] = set()  # child nodes that died and are not ready again: sends are dropped
        self._restarting: set[asyncio.Task] = set()
        self.shutdown_requested = asyncio.Event()  # set when a parent asks this node to stop
        # a node agent's children are stopped by the frontend of another host: a clean exit is no death
        self.clean_exit_is_stop = False
        self._stopping = False

    # ------------------------------------------------------------------ local actors

    async def spawn(self, actor: Actor) -> Actor:
        """Start a local actor: `on_start`, then its message loop as a task."""
        actor.system = self
        await actor.on_start()
        self.actors[actor.address] = actor
        self._tasks[actor.address] = asyncio.create_task(self._run(actor), name=f"actor:{actor.address}")
        return actor

    async def _run(self, actor: Actor) -> None:
        while True:
            msg = await actor.mailbox.get()
            if isinstance(msg, Shutdown):
                break
            try:
                await actor.handle(msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if actor.restart_on_crash:
                    actor = await self._restart(actor, msg, exc)
                    continue
                try:  # supervision: one bad message never kills the actor
                    await actor.on_error(msg, exc)
                except Exception:
                    log.exception("actor_on_error_failed", actor=actor.address)
        await actor.on_stop()

    async def _restart(self, actor: Actor, msg: Message, exc: Exception) -> Actor:
        """A crashed actor's state is suspect: it fails what it held, and a fresh instance takes its
        address and its mailbox (the messages queued behind the crash are not lost)."""
        log.error("actor_crashed", actor=actor.address, msg=type(msg).__name__, error=repr(exc), exc_info=exc)
        try:
            await actor.on_crash(msg, exc)
        except Exception:
            log.exception("actor_on_crash_failed", actor=actor.address)
        try:
            await actor.on_stop()
        except Exception:
            log.exception("actor_on_stop_failed", actor=actor.address)
        fresh = actor.fresh()
        fresh.mailbox = actor.mailbox
        fresh.system = self
        await fresh.on_start()
        self.actors[fresh.address] = fresh
        log.info("actor_restarted", actor=fresh.address)
        return fresh

    # ------------------------------------------------------------------ delivery

    async def send(self, to: str, msg: Message) -> None:
        if to == addresses.SYSTEM:
            self._system_message(msg)
            return
        actor = self.actors.get(to)
        if actor is not None:
            await actor.mailbox.put(msg)
            return
        node = self.placement.get(to)
        if node is None or node == self.node:
            log.warning("dropped_message_to_unknown_actor", to=to, msg=type(msg).__name__)
            return
        if node in self._down:  # its requests were failed when it died; a restart starts afresh
            log.debug("dropped_message_to_down_node", node=node, to=to, msg=type(msg).__name__)
            return
        await self._send_remote(node, Envelope(to, msg))

    async def send_to_node(self, node: str, to: str, msg: Message) -> None:
        await self._send_remote(node, Envelope(to, msg))

    async def _send_remote(self, node: str, env: Envelope) -> None:
        link = self._links.get(node)
        if link is None or link.closed:
            async with self._link_locks.setdefault(node, asyncio.Lock()):
                link = self._links.get(node)
                if link is None or link.closed:
                    link = await transport.connect(self._address(node))
                    self._links[node] = link
        try:
            await link.send(env)
        except (ConnectionError, OSError) as exc:
            log.warning("remote_send_failed", node=node, to=env.to, error=str(exc))

    async def _deliver(self, env: Envelope) -> None:
        await self.send(env.to, env.msg)

    def _system_message(self, msg: Message) -> None:
        if isinstance(msg, NodeReady):
            if msg.info.get("addr"):
                self.node_addrs[msg.node] = msg.info["addr"]
            self._down.discard(msg.node)
            fut = self.ready.setdefault(msg.node, asyncio.get_running_loop().create_future())
            if not fut.done():
                fut.set_result(msg)
            for cb in self.on_node_ready:
                cb(msg)
        elif isinstance(msg, NodeFailed):
            if msg.node in self.node_addrs and msg.node not in self._children:
                self._down.add(msg.node)  # a node of another host, reported by its host's agent
            fut = self.ready.get(msg.node)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"node {msg.node} failed to start: {msg.error}"))
            for cb in self.on_node_failed:
                cb(msg)
        elif isinstance(msg, Shutdown):
            self.shutdown_requested.set()

    # ------------------------------------------------------------------ processes

    def _sock_path(self, node: str) -> Path:
        assert self.sock_dir is not None, "cross-process delivery needs a socket directory"
        return self.sock_dir / f"{node.replace('/', '-')}.sock"

    def _address(self, node: str) -> Path | str:
        return self.node_addrs.get(node) or self._sock_path(node)

    async def listen(self) -> None:
        self._server = await transport.serve(self._address(self.node), self._deliver)

    async def start_child(self, node: str, module: str, payload: bytes, max_restarts: int = 0) -> None:
        """Start `python -m module` as a child process, handing it `payload` (msgpack) on stdin. A fresh
        interpreter, not a fork or multiprocessing spawn: the caller's __main__ is never re-imported. It
        runs in its own session, so a Ctrl-C at the terminal reaches only this process, which stops
        it in order. The child announces itself with NodeReady; its death is reported to `on_node_failed`
        subscribers, and it is started again up to `max_restarts` times in RESTART_WINDOW_S."""
        self._child_specs[node] = (module, payload, max_restarts)
        self.ready[node] = ready = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # a restart's has no waiter
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE, start_new_session=True
        )
        proc.stdin.write(payload)
        await proc.stdin.drain()
        proc.stdin.close()
        self._children[node] = proc
        asyncio.create_task(self._watch(node, proc), name=f"watch:{node}")

    async def _watch(self, node: str, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping or (code == 0 and self.clean_exit_is_stop):
            return
        log.error("node_died", node=node, exitcode=code)
        self._down.add(node)
        link = self._links.pop(node, None)
        if link is not None:
            await link.close()
        self._system_message(NodeFailed(node, f"process exited with code {code}"))
        module, payload, max_restarts = self._child_specs[node]
        recent = self._restarts.setdefault(node, deque())
        now = time.monotonic()
        while recent and now - recent[0] > RESTART_WINDOW_S:
            recent.popleft()
        if len(recent) >= max_restarts:
            log.error("node_not_restarted", node=node, restarts=len(recent), window_s=RESTART_WINDOW_S)
            return
        backoff = RESTART_BACKOFF_S[min(len(recent), len(RESTART_BACKOFF_S) - 1)]
        recent.append(now)
        log.warning("node_restarting", node=node, attempt=len(recent), backoff_s=backoff)
        await asyncio.sleep(backoff)  # a back-off, not synchronisation: a crash loop must not spin
        if not self._stopping:
            await self.start_child(node, module, payload, max_restarts)

    def stop_children(self, why: str) -> None:
        """Terminate every child process still running (they are reported failed as each exits and
        not restarted), and ask the nodes of other hosts to stop: one rank's death ends a world of many,
        whose collectives would wait for it."""
        for node, proc in self._children.items():
            if proc.returncode is None and node not in self._down:
                log.error("stopping_node", node=node, why=why)
                self._child_specs[node] = (*self._child_specs[node][:2], 0)
                proc.terminate()
        for node in self.remote_nodes():
            log.error("stopping_node", node=node, why=why)
            task = asyncio.get_running_loop().create_task(self._ask_to_stop(node))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)

    def remote_nodes(self) -> list[str]:
        """Nodes of other hosts this one knows (not its children), still up."""
        return [
            n for n in self.node_addrs if n != self.node and n not in self._children and n not in self._down
        ]

    async def _ask_to_stop(self, node: str) -> None:
        try:
            await asyncio.wait_for(self.send_to_node(node, addresses.SYSTEM, Shutdown()), 2)
        except (TimeoutError, OSError, ConnectionError):
            pass

    def expect(self, node: str) -> None:
        """Wait for a node that another host starts (`wait_ready` then waits for its NodeReady)."""
        self.ready.setdefault(node, asyncio.get_running_loop().create_future())

    async def wait_ready(self, node: str, timeout: float) -> NodeReady:
        return await asyncio.wait_for(asyncio.shield(self.ready[node]), timeout)

    # ------------------------------------------------------------------ shutdown

    async def stop(self, child_timeout: float = 10.0) -> None:
        """Orderly shutdown: children first (asked, then terminated), then local actors in reverse order."""
        self._stopping = True
        for node in self.remote_nodes():
            await self._ask_to_stop(node)
        for node, proc in self._children.items():
            if node in self._down:
                continue
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(self.send_to_node(node, addresses.SYSTEM, Shutdown()), 2)
                except (TimeoutError, OSError, ConnectionError):
                    pass
        for proc in self._children.values():
            for action in (None, proc.terminate, proc.kill):
                if proc.returncode is not None:
                    break
                if action is not None:
                    action()
                try:
                    await asyncio.wait_for(proc.wait(), child_timeout if action is None else 5)
                except TimeoutError:
                    pass
        for name in reversed(list(self.actors)):
            await self.actors[name].mailbox.put(Shutdown())
            try:
                await asyncio.wait_for(self._tasks[name], 10)
            except (TimeoutError, Exception):
                self._tasks[name].cancel()
        for link in self._links.values():
            await link.close()
        if self._server is not None:
            self._server.close()
        if self.sock_dir is not None and self.node not in self.node_addrs:
            self._sock_path(self.node).unlink(missing_ok=True)
