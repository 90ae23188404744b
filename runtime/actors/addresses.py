"""Actor addresses. The frontend's actors are one each; engine actors carry their rank, so one engine is
world size 1 through the same code as many: `worker/0` .. `worker/{world-1}` (one per GPU rank) and
`scheduler/dp0` .. (one per data-parallel rank, on its leader). A node (process) name says where actors
run: `frontend`, `engine/{rank}`, or `main` when everything runs in one process."""

from __future__ import annotations

CLIENT = "client"
TOKENIZER = "tokenizer"
DETOKENIZER = "detokenizer"
DP_CONTROLLER = "dp_controller"  # with DP attention: routes each request to a DP rank's scheduler
SYSTEM = "system"  # each node's own endpoint for lifecycle messages (NodeReady, NodeFailed, Shutdown)

FRONTEND_NODE = "frontend"
SINGLE_NODE = "main"


def worker(rank: int) -> str:
    return f"worker/{rank}"


def scheduler(dp_rank: int) -> str:
    return f"scheduler/dp{dp_rank}"


def engine_node(rank: int) -> str:
    return f"engine/{rank}"


def dp_group(rank: int, world_size: int, dp_size: int = 1) -> tuple[int, bool]:
    """(the DP rank of engine rank `rank`, whether it leads its group): ranks split into `dp_size`
    consecutive groups, each led by its first rank, which runs the group's scheduler."""
    group = world_size // dp_size
    return rank // group, rank % group == 0


def engine_actors(rank: int, world_size: int, dp_size: int = 1) -> list[str]:
    """The actors an engine rank runs: its worker, and its DP group's scheduler when it leads the group."""
    dp_rank, leads = dp_group(rank, world_size, dp_size)
    return [scheduler(dp_rank), worker(rank)] if leads else [worker(rank)]
