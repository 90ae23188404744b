"""`conduit gateway`'s flags and the frozen config built from them, once. Names, meanings and defaults
follow sglang-router's (`router_args.py`) where it has the flag."""

from __future__ import annotations

import argparse

import msgspec

from runtime.http.gateway.policies import POLICIES


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 26
    health_check_interval_secs: float = 60.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    retry_max_retries: int = 5
    request_timeout_secs: float = 1800.0
    # prefill/decode disaggregation (runtime/http/gateway/pd.py): requests go to a prefill server (by
    # the policy) and a decode server (the least loaded) together
    pd_disaggregation: bool = False
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        metavar="URL",
        help="`conduit serve` replicas, e.g. http://10.0.0.1:30000 (more can be added at run time: POST /workers)",
    )
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=d.policy,
        help="cache_aware: the worker that has the request's prefix cached, unless load is imbalanced; "
        "round_robin; power_of_two: the less loaded of two at random; random",
    )
    g = p.add_argument_group("cache_aware")
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=d.cache_threshold,
        help="route to the best-matching worker when its prefix match is more than this share of the "
        "request text (0-1); else to the least loaded",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=d.balance_abs_threshold,
        help="load is imbalanced (go to the least loaded, ignoring the cache) when max - min load > this "
        "and max > min * --balance-rel-threshold; load = requests in flight from this gateway",
    )
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold, help="see above")
    g.add_argument(
        "--max-tree-size",
        type=int,
        default=d.max_tree_size,
        help="characters of request text remembered per worker; past it the least recently used are "
        "evicted (at once, on insert)",
    )
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="pair prefill servers (--prefill) with decode servers (--decode) instead of --worker-urls",
    )
    g.add_argument(
        "--prefill", dest="prefill_urls", nargs="+", action="extend", default=[], metavar="URL",
        help="`conduit serve --disaggregation-mode prefill` servers",
    )  # fmt: skip
    g.add_argument(
        "--decode", dest="decode_urls", nargs="+", action="extend", default=[], metavar="URL",
        help="`conduit serve --disaggregation-mode decode` servers",
    )  # fmt: skip
    g = p.add_argument_group("health and retries")
    g.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=d.health_check_interval_secs,
        help="seconds between GET /health of every worker",
    )
    g.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs)
    g.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d.health_failure_threshold,
        help="consecutive failed checks that take a healthy worker out (a refused or dropped "
        "connection takes it out at once)",
    )
    g.add_argument(
        "--health-success-threshold",
        type=int,
        default=d.health_success_threshold,
        help="consecutive passed checks that bring an unhealthy worker back",
    )
    g.add_argument(
        "--retry-max-retries",
        type=int,
        default=d.retry_max_retries,
        help="attempts per request at most (1: no retry), each on another worker; only failures before "
        "any byte reached the client are retried",
    )
    g.add_argument(
        "--request-timeout-secs",
        type=float,
        default=d.request_timeout_secs,
        help="limit on one proxied HTTP request",
    )


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    fields = set(GatewayConfig.__struct_fields__)
    values = {k: v for k, v in vars(args).items() if k in fields}
    for key in ("worker_urls", "prefill_urls", "decode_urls"):
        values[key] = tuple(values.get(key) or ())
    if values.get("pd_disaggregation") and values["worker_urls"]:
        raise SystemExit(
            "conduit gateway: with --pd-disaggregation give --prefill and --decode, not --worker-urls"
        )
    if (values["prefill_urls"] or values["decode_urls"]) and not values.get("pd_disaggregation"):
        raise SystemExit("conduit gateway: --prefill and --decode need --pd-disaggregation")
    return GatewayConfig(**values)
