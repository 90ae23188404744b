"""What the server adds to requests and responses beyond the model: chosen once at start-up
(`conduit serve` flags, the model's generation_config.json) and read by the routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.generation_defaults import SamplingDefaults


@dataclass(frozen=True)
class ServingOptions:
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_call_parser: str = "hermes"  # the model's tool-call format (runtime/parsers/tool_calls)
    reasoning_parser: str | None = None  # "deepseek-r1" | "deepseek-v3": reasoning_content is split off
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    # prefill/decode disaggregation: {"mode", "backend", "bootstrap"} (GET /disaggregation); None: off
    disaggregation: dict[str, str] | None = None
