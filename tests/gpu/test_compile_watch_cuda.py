"""compile_watch against the device's own Triton: a kernel compiled while serving is reported by name."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu import compile_watch

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _add(X, value, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(X + offs, tl.load(X + offs) + value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compile_while_serving_is_a_warning_naming_the_kernel(monkeypatch):
    events = []
    log = type("L", (), {})()
    log.debug = lambda event, **kw: events.append(("debug", kw))
    log.warning = lambda event, **kw: events.append(("warning", kw))
    monkeypatch.setattr(compile_watch, "log", log)
    monkeypatch.setattr(compile_watch, "_state", {"installed": False, "serving": False})
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    compile_watch.install()
    x = torch.zeros(16, device="cuda")
    _add[(1,)](x, 1.0, N=16)  # start-up: debug
    compile_watch.mark_serving()
    _add[(1,)](x, 1.0, N=16)  # cached: nothing
    _add[(1,)](x, 1.0, N=8)  # a new constexpr: a new variant
    torch.cuda.synchronize()
    assert [(lvl, kw["kernel"], kw["mid_run"]) for lvl, kw in events] == [
        ("debug", "_add", False),
        ("warning", "_add", True),
    ]
    assert events[1][1]["seconds"] > 0 and "N" in events[1][1]["differs"]
