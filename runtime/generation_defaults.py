"""Sampling defaults from the model's `generation_config.json`, for requests that omit a parameter.

vLLM's behaviour and switch (`--generation-config`): `auto` (the default) reads the model directory's
generation_config.json; `vllm` ignores it (OpenAI's neutral defaults: temperature 1, top_p 1); a path (a
directory holding generation_config.json, or the JSON file itself) reads that instead.
`--override-generation-config JSON` is merged on top. Only the keys vLLM takes are used: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens (the default `max_tokens`). One addition:
Hugging Face's `"do_sample": false` means greedy there, so it defaults temperature to 0 here too (vLLM
ignores the key; the embedded SmolLM2's converted directory uses it, see `runtime/gpu/convert.py`).

A request's own value always wins; the defaults only fill what it left out (or sent as null).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

GENERATION_CONFIG = "generation_config.json"


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """Server-wide defaults for omitted sampling parameters; None: the OpenAI default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def describe(self) -> dict[str, Any]:
        return {k: v for k in self.__struct_fields__ if (v := getattr(self, k)) is not None}


def _read(source: Path) -> dict[str, Any]:
    path = source / GENERATION_CONFIG if source.is_dir() else source
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def from_generation_config(config: dict[str, Any]) -> SamplingDefaults:
    """The sampling defaults a generation_config.json's contents imply."""
    fields: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if config.get(key) is not None:
            fields[key] = float(config[key])
    if config.get("top_k") is not None:
        fields["top_k"] = int(config["top_k"])
    if config.get("max_new_tokens") is not None:
        fields["max_tokens"] = int(config["max_new_tokens"])
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0  # Hugging Face: greedy whatever the temperature says
    return SamplingDefaults(**fields)


def load_sampling_defaults(
    mode: str, model_path: str, overrides: dict[str, Any] | None = None
) -> SamplingDefaults:
    """`mode` is `--generation-config`: "auto" (the model's file), "vllm" (none), or a path."""
    if mode == "vllm":
        config: dict[str, Any] = {}
    elif mode == "auto":
        config = _read(Path(model_path))
    else:
        source = Path(mode)
        if not source.exists():
            raise FileNotFoundError(f"--generation-config {mode}: no such file or directory")
        config = _read(source)
    defaults = from_generation_config(config)
    if overrides:  # an override's value wins, even over the model's do_sample=false
        defaults = msgspec.structs.replace(defaults, **from_generation_config(overrides).describe())
    return defaults
