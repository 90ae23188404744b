"""`conduit gateway`: one address in front of many `conduit serve` replicas (HTTP only: no torch, no
actors). Routes each request by policy (cache_aware, round_robin, power_of_two, random), streams the
answers through, checks the workers' health and retries elsewhere before any byte was sent.
docs/gateway.md describes it."""

from runtime.http.gateway.app import build_gateway_app, serve_gateway
from runtime.http.gateway.config import GatewayConfig, add_gateway_flags, gateway_config_from_args

__all__ = [
    "GatewayConfig",
    "add_gateway_flags",
    "build_gateway_app",
    "gateway_config_from_args",
    "serve_gateway",
]
