"""compile_watch: Triton compiles logged by kernel, quietly at start-up and as warnings once serving."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.gpu import compile_watch

knobs = pytest.importorskip("triton").knobs


class _Log:
    def __init__(self):
        self.events = []

    def debug(self, event, **kw):
        self.events.append(("debug", event, kw))

    def warning(self, event, **kw):
        self.events.append(("warning", event, kw))


@pytest.fixture
def watch(monkeypatch):
    """A fresh watcher over recording hooks that stand for ones installed before it (say a profiler's)."""
    chained = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: chained.append(("before", kw["key"])))
    monkeypatch.setattr(
        knobs.runtime, "jit_post_compile_hook", lambda **kw: chained.append(("after", kw["key"]))
    )
    monkeypatch.setattr(compile_watch, "_state", {"installed": False, "serving": False})
    monkeypatch.setattr(compile_watch, "_variants", {})
    log = _Log()
    monkeypatch.setattr(compile_watch, "log", log)
    compile_watch.install()
    compile_watch.install()  # idempotent: the hooks are chained once
    return log, chained


def _compile(key: str, splits_div16: bool) -> None:
    """What Triton hands its hooks for one variant of `_stage2(MidO, num_splits, BLOCK_S)`."""
    attrs = {(0,): [["tt.divisibility", 16]]}
    if splits_div16:
        attrs[(1,)] = [["tt.divisibility", 16]]
    record = {
        "key": key,
        "signature": {"MidO": "*fp32", "num_splits": "i32", "BLOCK_S": "constexpr"},
        "constants": {(2,): 16},
        "configs": [attrs],
    }
    info = SimpleNamespace(name="_stage2")
    for hook in (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook):
        hook(key=key, repr="_stage2[num_warps=4](...)", fn=info, compile=record)


def test_compiles_are_debug_at_start_up_and_warnings_naming_what_changed_while_serving(watch):
    log, chained = watch
    _compile("a", splits_div16=False)
    compile_watch.mark_serving()
    _compile("b", splits_div16=True)
    assert [(lvl, kw["kernel"], kw["mid_run"]) for lvl, _, kw in log.events] == [
        ("debug", "_stage2", False),
        ("warning", "_stage2", True),
    ]
    assert all(kw["seconds"] is not None and kw["seconds"] >= 0 for _, _, kw in log.events)
    # the argument that made the new variant, against the one compiled at start-up
    assert log.events[1][2]["differs"] == {"num_splits": "i32 -> i32 tt.divisibility=16"}
    assert compile_watch.describe(
        {"compile": {"signature": {"MidO": "*fp32", "BLOCK_S": "constexpr"}, "constants": {(1,): 16}}}
    ) == {"MidO": "*fp32", "BLOCK_S": "constexpr=16"}
    # the hooks that were there before still see every compile, once
    assert chained == [("before", "a"), ("after", "a"), ("before", "b"), ("after", "b")]
