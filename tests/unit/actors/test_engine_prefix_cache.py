"""How the engine sets up prefix caching per model: DeepSeek-V4 gets the radix cache, pages raised to
whole compression windows and replay before hits; a model that declares it cannot reuse a prefix is
served without the radix cache (and its runner refuses one); other models are unchanged. The V4 runner
refuses slots that break its paged pools' addressing and frees a released row's state."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from runtime.actors import addresses
from runtime.actors.engine_process import spawn_engine_actors
from runtime.actors.scheduler.prefix_cache import PrefixCache
from runtime.actors.scheduler.radix_cache import RadixCache
from runtime.actors.system import ActorSystem
from runtime.config import RunnerConfig, ServerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models import ModelAbilities
from runtime.gpu.models.llama import LlamaForCausalLM
from runtime.gpu.testing import (
    PagedPlanBuilder,
    PlanBuilder,
    save_tiny_deepseek_v4,
    save_tiny_llama,
    seq_start,
)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v4")
    save_tiny_deepseek_v4(path, seed=0)  # window 8, compress rates 4 and 8
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, seed=0)
    return path


def engine(model_dir, **overrides):
    async def main():
        system = ActorSystem("engine", {})
        cfg = ServerConfig(model=str(model_dir), max_total_tokens=1024, max_running_requests=4, **overrides)
        try:
            await spawn_engine_actors(system, cfg, str(model_dir), max_model_len=128)
            return system.actors[addresses.scheduler(0)], system.actors[addresses.worker(0)].runner
        finally:
            await system.stop()

    return asyncio.run(main())


def test_v4_gets_the_radix_cache_whole_window_pages_and_replay(v4_dir):
    sched, runner = engine(v4_dir, page_size=4)
    assert isinstance(sched.cache, RadixCache)
    assert sched.allocator.page_size == 8  # raised to the lcm of the compress rates (logged)
    assert runner.prefix_replay == sched.planner.prefix_replay == 8  # the sliding window
    sched, runner = engine(v4_dir, page_size=16, swa_replay_tokens=20)
    assert sched.allocator.page_size == 16 and sched.planner.prefix_replay == 20
    sched, _ = engine(v4_dir, swa_replay_exact=True)
    assert sched.planner.prefix_replay == 128  # every position: a hit replays from 0


def test_models_that_cannot_reuse_a_prefix_get_no_radix_cache(llama_dir, monkeypatch):
    sched, runner = engine(llama_dir)
    assert isinstance(sched.cache, RadixCache) and runner.prefix_replay == 0
    sched, _ = engine(llama_dir, disable_radix_cache=True)  # the flag still turns it off
    assert type(sched.cache) is PrefixCache
    monkeypatch.setattr(LlamaForCausalLM, "abilities", ModelAbilities(prefix_cache=False))
    sched, runner = engine(llama_dir)
    assert runner.capabilities().prefix_cache is False
    assert type(sched.cache) is PrefixCache  # the trivial cache: never a prefix hit
    ids = list(range(3, 13))
    start = msgspec.structs.replace(seq_start(1, ids), prefix_slots=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="cached prefix"):
        runner.execute(PlanBuilder().plan([1], [4], [6], ids[4:], added=[start]))


def test_v4_runner_refuses_slots_not_aligned_to_positions(v4_dir):
    runner = ModelRunner(RunnerConfig(str(v4_dir), num_kv_slots=256, max_reqs=2, max_model_len=128))
    ids = list(range(3, 13))
    with pytest.raises(ValueError, match="aligned"):  # contiguous slots from 1: position p at slot p + 1
        runner.execute(PlanBuilder().plan([1], [0], [10], ids, added=[seq_start(1, ids)]))


def test_v4_state_of_a_released_row_is_freed(v4_dir):
    runner = ModelRunner(RunnerConfig(str(v4_dir), num_kv_slots=256, max_reqs=2, max_model_len=128))
    pb, ids = PagedPlanBuilder(8, num_slots=256), list(range(3, 23))
    runner.execute(
        pb.plan([1, 2], [0, 0], [10, 10], ids, added=[seq_start(1, ids[:10]), seq_start(2, ids[10:])])
    )
    assert set(runner.kv_pool.rows) == {1, 2}
    runner.execute(pb.plan([2], [10], [1], [5], released=[1]))  # row 1 left; row 2 decodes on
    assert set(runner.kv_pool.rows) == {2}
    with pytest.raises(NotImplementedError):  # a continuation of a freed row is refused, not served stale
        runner.execute(pb.plan([1], [10], [1], [5]))
