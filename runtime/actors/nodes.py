"""Engines spanning several machines (`--nnodes`): where each node's actors listen, and the agent that
runs a non-zero node's ranks.

Every machine runs the same `conduit serve` with its `--node-rank`. Node 0 runs the frontend (HTTP,
tokenizer, detokenizer) and its ranks; node k > 0 runs only its ranks, under `run_node_agent`. Ranks
[k * R, (k + 1) * R) live on node k (R = world / nnodes). With `--dist-init-addr HOST:PORT` (node 0's
address), torch.distributed gathers at PORT, the frontend's mailbox listens at PORT + 1 and rank r's at
PORT + 2 + r on its node's address. A rank of another node announces its address in its NodeReady; the
frontend then passes every rank's address to every other rank, before it serves. A rank's death on
node k is reported by k's agent to the frontend, which stops every rank."""

from __future__ import annotations

import asyncio
import signal
import socket
import tempfile
from pathlib import Path

import msgspec
import structlog

from runtime.actors import addresses
from runtime.config import ServerConfig
from runtime.mailbox.messages import NodeFailed

log = structlog.get_logger(__name__)


def init_host_port(cfg: ServerConfig) -> tuple[str, int]:
    host, _, port = (cfg.dist_init_addr or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {cfg.dist_init_addr!r}")
    return host, int(port)


def local_ranks(cfg: ServerConfig, world_size: int) -> range:
    per_node = world_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def own_address(toward: str) -> str:
    """This machine's address on the route to `toward` (node 0), as other nodes reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def frontend_address(cfg: ServerConfig) -> str:
    host, port = init_host_port(cfg)
    return f"tcp://{host}:{port + 1}"


def rank_address(cfg: ServerConfig, rank: int) -> str:
    host, port = init_host_port(cfg)
    mine = host if cfg.node_rank == 0 else own_address(host)
    return f"tcp://{mine}:{port + 2 + rank}"


def node_addrs(cfg: ServerConfig, world_size: int) -> dict[str, str]:
    """The TCP addresses this node knows at start: the frontend's and its own ranks'."""
    out = {addresses.FRONTEND_NODE: frontend_address(cfg)}
    out |= {addresses.engine_node(r): rank_address(cfg, r) for r in local_ranks(cfg, world_size)}
    return out


async def run_node_agent(cfg: ServerConfig) -> None:
    """Node k > 0: start this node's ranks (their NodeReady goes to node 0's frontend), report a death to
    the frontend, and stop them on SIGINT/SIGTERM or when node 0 stopped them."""
    from runtime.actors.engine_process import EngineArgs, dp_groups
    from runtime.actors.system import ActorSystem
    from runtime.model_info import load_model_info, resolve_model_path

    cfg.check_parallelism()
    world = cfg.world_size()
    model_path = resolve_model_path(cfg)
    info = load_model_info(cfg, model_path)
    dp_size = dp_groups(cfg, world)
    placement = {a: addresses.FRONTEND_NODE for a in (addresses.CLIENT, addresses.TOKENIZER)}
    placement |= {a: addresses.FRONTEND_NODE for a in (addresses.DETOKENIZER, addresses.DP_CONTROLLER)}
    for rank in range(world):
        placement |= {a: addresses.engine_node(rank) for a in addresses.engine_actors(rank, world, dp_size)}
    known = node_addrs(cfg, world)
    sock_dir = Path(tempfile.mkdtemp(prefix="conduit-node-"))
    system = ActorSystem(f"agent/{cfg.node_rank}", placement, sock_dir, known)
    system.clean_exit_is_stop = True
    stop = asyncio.Event()

    def died(msg: NodeFailed) -> None:
        task = asyncio.get_running_loop().create_task(
            system.send_to_node(addresses.FRONTEND_NODE, addresses.SYSTEM, msg)
        )
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        system.stop_children(f"{msg.node} died")

    system.on_node_failed.append(died)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dist_addr = cfg.dist_init_addr
    procs = []
    for rank in local_ranks(cfg, world):
        node = addresses.engine_node(rank)
        args = EngineArgs(
            cfg, placement, str(sock_dir), model_path, info.max_model_len, addresses.FRONTEND_NODE,
            rank, world, dist_addr, {addresses.FRONTEND_NODE: known[addresses.FRONTEND_NODE], node: known[node]},
        )  # fmt: skip
        await system.start_child(node, "runtime.actors.engine_process", msgspec.msgpack.encode(args))
        procs.append(system._children[node])
    log.info("node_started", node_rank=cfg.node_rank, ranks=list(local_ranks(cfg, world)))
    exited = asyncio.gather(*(p.wait() for p in procs))
    await asyncio.wait([exited, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    await system.stop()
    log.info("node_stopped", node_rank=cfg.node_rank)
