"""The disaggregation flags of `conduit serve`, and what the engine's worker needs of them."""

from __future__ import annotations

import argparse

import msgspec

MODES = ("prefill", "decode")
BACKENDS = ("tcp", "shm", "nccl", "nixl", "mooncake")


class DisaggConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One server's side of prefill/decode disaggregation (built from its ServerConfig)."""

    mode: str  # "prefill" | "decode"
    backend: str = "tcp"
    host: str = "127.0.0.1"  # the decode server's transfer listener (the prefill side connects to it)
    bootstrap_port: int = 8998
    timeout: float = 60.0  # seconds: a transfer (or a reservation waiting for one) fails after this

    @property
    def address(self) -> str:
        return f"{self.host}:{self.bootstrap_port}"

    @classmethod
    def from_server(cls, cfg) -> DisaggConfig | None:  # noqa: ANN001 (ServerConfig: no import cycle)
        if cfg.disaggregation_mode is None:
            return None
        return cls(
            mode=cfg.disaggregation_mode,
            backend=cfg.disaggregation_transfer_backend,
            host=cfg.host,
            bootstrap_port=cfg.disaggregation_bootstrap_port,
            timeout=cfg.disaggregation_transfer_timeout,
        )


def add_disaggregation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument(
        "--disaggregation-mode",
        choices=MODES,
        default=None,
        help="serve only the prefill (compute the prompt, send its KV and first token to a decode "
        "server) or only the decode side of requests paired by `conduit gateway --pd-disaggregation`",
    )
    g.add_argument(
        "--disaggregation-transfer-backend",
        choices=BACKENDS,
        default="tcp",
        help="how KV moves: tcp (asyncio streams), shm (shared memory, one host), nccl (torch.distributed "
        "point-to-point; gloo on CPU), nixl / mooncake (when installed)",
    )
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="decode mode: the port (on --host) where prefill servers connect to send KV",
    )
    g.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=60.0,
        help="seconds before a KV transfer, or a decode reservation waiting for one, fails",
    )
