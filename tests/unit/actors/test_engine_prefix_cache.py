"""A model that cannot reuse a cached prefix (DeepSeek-V4) never gets one: its runner says so and the
engine builds the scheduler without the radix cache; other models keep it."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from runtime.actors.engine_process import spawn_engine_actors
from runtime.actors.scheduler.prefix_cache import PrefixCache
from runtime.actors.scheduler.radix_cache import RadixCache
from runtime.actors.system import ActorSystem
from runtime.config import ServerConfig
from runtime.gpu.model_runner import ModelRunner, RunnerConfig
from runtime.gpu.testing import PlanBuilder, save_tiny_deepseek_v4, save_tiny_llama, seq_start


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v4")
    save_tiny_deepseek_v4(path, seed=0)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, seed=0)
    return path


def engine_cache(model_dir, **overrides):
    async def main():
        system = ActorSystem("engine", {})
        cfg = ServerConfig(model=str(model_dir), max_total_tokens=1024, max_running_requests=4, **overrides)
        try:
            await spawn_engine_actors(system, cfg, str(model_dir), max_model_len=128)
            return system.actors["scheduler"].cache, system.actors["worker"].runner
        finally:
            await system.stop()

    return asyncio.run(main())


def test_v4_is_served_without_the_radix_cache(v4_dir):
    cache, runner = engine_cache(v4_dir)
    assert runner.supports_prefix_cache is False
    assert type(cache) is PrefixCache  # the trivial cache: never a prefix hit


def test_other_models_keep_the_radix_cache(llama_dir):
    cache, runner = engine_cache(llama_dir)
    assert runner.supports_prefix_cache is True
    assert isinstance(cache, RadixCache)
    cache, _ = engine_cache(llama_dir, disable_radix_cache=True)  # the flag still turns it off
    assert type(cache) is PrefixCache


def test_v4_runner_refuses_a_cached_prefix(v4_dir):
    runner = ModelRunner(RunnerConfig(str(v4_dir), num_kv_slots=256, max_reqs=2, max_model_len=128))
    ids = list(range(3, 13))
    start = msgspec.structs.replace(seq_start(1, ids), prefix_slots=[0, 1, 2, 3])
    plan = PlanBuilder().plan([1], [4], [6], ids[4:], added=[start])
    with pytest.raises(ValueError, match="cached prefix"):
        runner.execute(plan)


def test_v4_state_of_a_released_row_is_freed(v4_dir):
    runner = ModelRunner(RunnerConfig(str(v4_dir), num_kv_slots=256, max_reqs=2, max_model_len=128))
    pb, ids = PlanBuilder(), list(range(3, 23))
    runner.execute(
        pb.plan([1, 2], [0, 0], [10, 10], ids, added=[seq_start(1, ids[:10]), seq_start(2, ids[10:])])
    )
    assert set(runner.kv_cache.rows) == {1, 2}
    runner.execute(pb.plan([2], [10], [1], [5], released=[1]))  # row 1 left; row 2 decodes on
    assert set(runner.kv_cache.rows) == {2}
    with pytest.raises(NotImplementedError):  # a continuation of a freed row is refused, not served stale
        runner.execute(pb.plan([1], [10], [1], [5]))
