"""Conduit's server runtime. `runtime.Engine` is the offline API (imported lazily: it pulls in torch)."""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Engine", "Output"):
        from runtime import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from runtime.mailbox.messages import SamplingParams

        return SamplingParams
    raise AttributeError(name)
