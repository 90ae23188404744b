"""Log every Triton kernel compile, and flag the ones that happen while serving.

A Triton kernel compiles once per specialisation of its arguments (constexprs, integers equal to 1 or
divisible by 16, pointer alignment). A shape that start-up and the warm-up steps never launched
compiles on the step that first needs it: a second or so of stalled device, in the middle of a
benchmark (a 16K-token step took 1.4 s instead of 0.4 s on the H200). The runner's warm-up is meant to cover every launch shape;
this watcher shows, by kernel and signature, what it missed."""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger(__name__)

_started: dict[str, float] = {}
_state = {"installed": False, "serving": False}
_variants: dict[str, list[dict[str, str]]] = {}  # kernel name -> each compiled variant's arguments


def describe(kwargs: dict) -> dict[str, str]:
    """One compiled variant, argument by argument: its type, value when constant and what Triton assumed
    of it (e.g. `tt.divisibility=16`), from the hook's `compile` record. Empty if Triton changed it."""
    try:
        comp = kwargs.get("compile") or {}
        sig = dict(comp.get("signature") or {})
        names = list(sig)
        desc = {name: str(ty) for name, ty in sig.items()}

        def name_of(k) -> str:
            i = k[0] if isinstance(k, tuple) and k else k
            return names[i] if isinstance(i, int) and 0 <= i < len(names) else str(k)

        for k, v in (comp.get("constants") or {}).items():
            desc[name_of(k)] = f"{desc.get(name_of(k), '')}={getattr(v, 'value', v)}"
        for k, v in ((comp.get("configs") or [{}])[0] or {}).items():
            desc[name_of(k)] = f"{desc.get(name_of(k), '')} " + ",".join(f"{a}={b}" for a, b in v)
        return desc
    except Exception:  # noqa: BLE001 - a diagnostic must never break a compile
        return {}


def _difference(new: dict[str, str], earlier: list[dict[str, str]]) -> dict[str, str]:
    """The arguments in which `new` differs from the closest earlier variant: what made it compile."""
    if not earlier or not new:
        return {}
    closest = min(earlier, key=lambda old: sum(old.get(a) != d for a, d in new.items()))
    return {a: f"{closest.get(a)} -> {d}" for a, d in new.items() if closest.get(a) != d}


def install() -> None:
    """Chain timing hooks onto Triton's JIT compile hooks (idempotent; a no-op without Triton)."""
    if _state["installed"]:
        return
    try:
        from triton import knobs
    except ImportError:  # CPU-only installs, or a Triton without knobs
        return
    runtime = knobs.runtime
    before_prev, after_prev = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def before(*args, **kwargs):
        _started[str(kwargs.get("key"))] = time.perf_counter()
        # a truthy return tells Triton to skip the compile: only the chained hook may decide that
        return before_prev(*args, **kwargs) if before_prev else None

    def after(*args, **kwargs):
        t0 = _started.pop(str(kwargs.get("key")), None)
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        seconds = None if t0 is None else round(time.perf_counter() - t0, 3)
        variant = describe(kwargs)
        earlier = _variants.setdefault(name, [])
        if _state["serving"]:
            log.warning("triton_compile", kernel=name, seconds=seconds, mid_run=True,
                        differs=_difference(variant, earlier) or str(kwargs.get("repr", ""))[:600])  # fmt: skip
        else:
            log.debug("triton_compile", kernel=name, seconds=seconds, mid_run=False)
        earlier.append(variant)
        return after_prev(*args, **kwargs) if after_prev else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    _state["installed"] = True


def mark_serving() -> None:
    """Start-up and warm-up are over: from now on a compile stalls a request, so it is a warning."""
    _state["serving"] = True
