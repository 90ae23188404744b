"""The op registry: per op, its implementations in preference order; `select` takes the first available.

An implementation is a name, a `module:function` target (imported only when chosen) and an
`available(device)` check. Order is the preference: DeepSeek libraries (flash_mla, deep_gemm, deep_ep)
when importable, then ours (TileLang, Triton), then the PyTorch reference, which is always available.
`$CONDUIT_KERNEL_<OP>=<name>` (see `runtime.envs.forced_kernel`) forces one, for comparisons; it is read
at the op's first use (`clear_cache()` re-reads it)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from runtime import envs


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    target: str  # "package.module:function"
    available: Callable[[torch.device], bool]

    def load(self) -> Callable[..., Any]:
        module, fn = self.target.split(":")
        return getattr(importlib.import_module(module), fn)


_OPS: dict[str, list[Impl]] = {}


def register(op: str, name: str, target: str, available: Callable[[torch.device], bool]) -> None:
    """Append an implementation; call in preference order (fastest first, reference last)."""
    impls = _OPS.setdefault(op, [])
    if any(i.name == name for i in impls):
        raise ValueError(f"{op}: implementation {name!r} registered twice")
    impls.append(Impl(op, name, target, available))
    clear_cache()


def clear_cache() -> None:
    """Forget the choices made so far and re-read CONDUIT_KERNEL_* (after registering; in tests)."""
    _select_cached.cache_clear()
    _get_cached.cache_clear()
    _forced.cache_clear()


# ------------------------------------------------------------------ availability checks


@cache
def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def always(device: torch.device) -> bool:
    return True


def triton_on_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and has_module("triton")


def tilelang_on_hopper(device: torch.device) -> bool:
    """For TileLang kernels (wgmma, TMA, setmaxnreg): a Hopper GPU and `import tilelang` works."""
    return device.type == "cuda" and is_hopper(device) and tilelang_importable()


def is_hopper(device: torch.device) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9


@cache
def tilelang_importable() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (missing CUDA libs, ...) counts as absent
        return False
    return True


def module_on_cuda(module: str) -> Callable[[torch.device], bool]:
    """For library adapters: available on CUDA devices when `module` imports (e.g. flash_mla)."""

    def check(device: torch.device) -> bool:
        return device.type == "cuda" and has_module(module)

    return check


# ------------------------------------------------------------------ choosing


def ops() -> list[str]:
    _load_ops()
    return sorted(_OPS)


def implementations(op: str) -> list[Impl]:
    _load_ops()
    if op not in _OPS:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(_OPS)}")
    return list(_OPS[op])


def named(op: str, name: str) -> Impl:
    """The implementation of `op` called `name`, whether or not it is available here."""
    for impl in implementations(op):
        if impl.name == name:
            return impl
    raise KeyError(f"{op}: no implementation {name!r}; known: {[i.name for i in implementations(op)]}")


def select(op: str, device: torch.device | str) -> Impl:
    """The implementation `op` uses on `device`: the forced one, else the first available."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _select_cached(op, device, _forced(op))


@cache
def _select_cached(op: str, device: torch.device, forced: str | None) -> Impl:
    impls = implementations(op)
    if forced:
        for impl in impls:
            if impl.name == forced:
                if not impl.available(device):
                    raise RuntimeError(f"CONDUIT_KERNEL_{op.upper()}={forced} is not available on {device}")
                return impl
        raise ValueError(f"CONDUIT_KERNEL_{op.upper()}={forced}: choose from {[i.name for i in impls]}")
    for impl in impls:
        if impl.available(device):
            return impl
    raise RuntimeError(f"no implementation of {op} is available on {device}")


def get(op: str, device: torch.device | str) -> Callable[..., Any]:
    """The function to call for `op` on `device` (cheap enough to call per layer: a cached lookup)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _get_cached(op, device, _forced(op))


@cache
def _forced(op: str) -> str | None:
    # read once per process (an environ lookup costs microseconds, and layers ask on every call)
    return envs.forced_kernel(op)


@cache
def _get_cached(op: str, device: torch.device, forced: str | None) -> Callable[..., Any]:
    return _select_cached(op, device, forced).load()


def describe(device: torch.device | str) -> dict[str, str]:
    """{op: chosen implementation} on `device` (what `conduit serve --kernels` prints)."""
    return {op: select(op, device).name for op in ops()}


@cache
def _load_ops() -> None:
    """Import the op packages; each registers its implementations in its `__init__`."""
    importlib.import_module("runtime.gpu.kernels")
