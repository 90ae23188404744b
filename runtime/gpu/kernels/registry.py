"""The op registry: per op, its contract and its implementations in preference order; `select` takes the
first available.

An op is an `Op` handle, made once in its package's `__init__` from a name and a `typing.Protocol`
whose `__call__` is the op's contract (shapes, dtypes, semantics): `RMS_NORM = Op("rms_norm", RmsNorm)`.
`RMS_NORM.get(device)` is the function to call, typed as that protocol. An implementation is a name, a
`module:function` target (imported only when chosen) and an `available(device)` check, registered on
the handle. Order is the preference: DeepSeek libraries (flash_mla, deep_gemm) when importable, then
ours (TileLang, Triton), then the PyTorch reference, which is always available.
`$CONDUIT_KERNEL_<OP>=<name>` (see `runtime.envs.forced_kernel`) forces one, for comparisons; it is read
at the op's first use (`clear_cache()` re-reads it). `ops()`, `op(name)` and `describe()` list the ops
by name (`conduit serve --kernels`)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar, cast

import torch

from runtime import envs

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Impl(Generic[F]):
    op: str
    name: str
    target: str  # "package.module:function"
    available: Callable[[torch.device], bool]

    def load(self) -> F:
        module, fn = self.target.split(":")
        return cast(F, getattr(importlib.import_module(module), fn))


_OPS: dict[str, Op[Any]] = {}
_UNREAD = object()  # an op's $CONDUIT_KERNEL_<OP> before its first use


class Op(Generic[F]):
    """One kernel op: its name, its contract (`contract`, a Protocol of `__call__`) and its
    implementations in preference order. Choices are cached per device (cheap enough to ask per layer)."""

    def __init__(self, name: str, contract: type[F]) -> None:
        if name in _OPS:
            raise ValueError(f"kernel op {name!r} declared twice")
        self.name = name
        self.contract = contract
        self._impls: list[Impl[F]] = []
        self._forced: object = _UNREAD
        self._chosen: dict[torch.device, Impl[F]] = {}
        self._loaded: dict[torch.device, F] = {}
        _OPS[name] = self

    def __repr__(self) -> str:
        return f"Op({self.name!r}, {self.contract.__name__})"

    def register(self, name: str, target: str, available: Callable[[torch.device], bool]) -> None:
        """Append an implementation; call in preference order (fastest first, reference last)."""
        if any(i.name == name for i in self._impls):
            raise ValueError(f"{self.name}: implementation {name!r} registered twice")
        self._impls.append(Impl(self.name, name, target, available))
        self.clear_cache()

    def implementations(self) -> list[Impl[F]]:
        return list(self._impls)

    def named(self, name: str) -> Impl[F]:
        """The implementation called `name`, whether or not it is available here."""
        for impl in self._impls:
            if impl.name == name:
                return impl
        raise KeyError(f"{self.name}: no implementation {name!r}; known: {[i.name for i in self._impls]}")

    def select(self, device: torch.device | str) -> Impl[F]:
        """The implementation this op uses on `device`: the forced one, else the first available."""
        device = device if isinstance(device, torch.device) else torch.device(device)
        impl = self._chosen.get(device)
        if impl is None:
            impl = self._chosen[device] = self._choose(device)
        return impl

    def get(self, device: torch.device | str) -> F:
        """The function to call on `device` (a cached lookup)."""
        device = device if isinstance(device, torch.device) else torch.device(device)
        fn = self._loaded.get(device)
        if fn is None:
            fn = self._loaded[device] = self.select(device).load()
        return fn

    def clear_cache(self) -> None:
        """Forget the choices made so far and re-read CONDUIT_KERNEL_<OP> at the next use."""
        self._forced = _UNREAD
        self._chosen.clear()
        self._loaded.clear()

    def _choose(self, device: torch.device) -> Impl[F]:
        if self._forced is _UNREAD:  # read once per process: layers ask on every call
            self._forced = envs.forced_kernel(self.name)
        forced = cast("str | None", self._forced)
        if forced:
            impl = next((i for i in self._impls if i.name == forced), None)
            if impl is None:
                names = [i.name for i in self._impls]
                raise ValueError(f"CONDUIT_KERNEL_{self.name.upper()}={forced}: choose from {names}")
            if not impl.available(device):
                raise RuntimeError(
                    f"CONDUIT_KERNEL_{self.name.upper()}={forced} is not available on {device}"
                )
            return impl
        for impl in self._impls:
            if impl.available(device):
                return impl
        raise RuntimeError(f"no implementation of {self.name} is available on {device}")


def clear_cache() -> None:
    """Every op forgets its choices and re-reads CONDUIT_KERNEL_* (in tests)."""
    for op_ in _OPS.values():
        op_.clear_cache()


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


# ------------------------------------------------------------------ listing by name


def ops() -> list[str]:
    _load_ops()
    return sorted(_OPS)


def op(name: str) -> Op[Any]:
    """The op called `name` (for listings, benchmarks and tests that take op names)."""
    _load_ops()
    if name not in _OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {sorted(_OPS)}")
    return _OPS[name]


def describe(device: torch.device | str) -> dict[str, str]:
    """{op: chosen implementation} on `device` (what `conduit serve --kernels` prints)."""
    return {name: op(name).select(device).name for name in ops()}


@cache
def _load_ops() -> None:
    """Import the op packages; each declares its ops and registers their implementations in `__init__`."""
    importlib.import_module("runtime.gpu.kernels")
