"""The Buffer class the DeepEP adapter uses instead of `deep_ep.Buffer`, when a test installs one (a CPU
stand-in: runtime/gpu/testing/fake_deep_ep.py); None in serving."""

from __future__ import annotations

buffer_class = None


def install(cls) -> None:  # noqa: ANN001
    global buffer_class
    buffer_class = cls
