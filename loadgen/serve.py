"""`loadgen serve`: send a dataset to a running server at Poisson arrivals and measure it."""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from urllib.parse import urlsplit

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from loadgen import datasets, gpu_clock, metrics, report
from loadgen.arrival import paced
from loadgen.backends import RequestConfig, connect_error, error_message, send
from loadgen.errors import LoadgenError
from loadgen.records import RequestResult
from loadgen.tokens import load_codec


def base_url(args) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"--base-url must be http://host:port or https://..., got {url!r}")
    return url.removesuffix("/v1")


def check_args(args) -> None:
    if args.duration is None and args.num_prompts is None:
        args.num_prompts = 1000
    if args.duration is not None and math.isinf(args.request_rate) and args.max_concurrency is None:
        raise LoadgenError("--duration with --request-rate inf needs --max-concurrency (else it never waits)")
    if args.dataset_name == "random-ids" and args.backend == "chat":
        raise LoadgenError("--dataset-name random-ids sends token ids: use --backend completions")
    if args.request_rate <= 0:
        raise LoadgenError("--request-rate must be > 0 (inf: all at once)")


async def fetch_models(session: aiohttp.ClientSession, url: str) -> dict | None:
    """The server's /v1/models answer. A server that is down is fatal; a bad answer is a warning."""
    try:
        async with session.get(url + "/v1/models", allow_redirects=False) as resp:
            if resp.status != 200:
                print(f"warning: GET /v1/models answered {await error_message(resp)}", file=sys.stderr)
                return None
            return msgspec.json.decode(await resp.read())
    except aiohttp.ClientConnectorError as e:
        raise LoadgenError(connect_error(url, e)) from None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise LoadgenError(f"GET {url}/v1/models failed: {type(e).__name__}: {e}") from None
    except msgspec.DecodeError:
        print("warning: GET /v1/models answered bad JSON", file=sys.stderr)
        return None


def pick_model(args, models: dict | None) -> str:
    if args.model:
        return args.model
    try:
        return models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        raise LoadgenError("no --model given and /v1/models lists none") from None


async def run(args) -> int:
    check_args(args)
    url = base_url(args)
    codec = load_codec(args.tokenizer)
    rng = np.random.default_rng(args.seed)
    pool = args.num_prompts or 1000
    prompts = datasets.build(args, codec, pool, rng)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        models = await fetch_models(session, url)
        cfg = RequestConfig(
            url, pick_model(args, models), not args.no_ignore_eos, args.temperature, args.ws_endpoint
        )
        for i in range(args.warmup_requests):
            r = await send(args.backend, session, cfg, prompts[i % len(prompts)], -1 - i, time.perf_counter())
            if not r.success:
                print(f"warning: warmup request failed: {r.error}", file=sys.stderr)
                break
        try:
            # the clock a power-capped GPU ran at (gpu_clock.py), where the server is on this machine
            with gpu_clock.GpuSampler(enabled=gpu_clock.is_local(url)) as gpu:
                results, duration = await _benchmark(args, session, cfg, prompts, rng)
        finally:
            if cfg.ws:
                await cfg.ws.close()
    started_at = time.time() - duration
    if codec.exact:
        for r in results:
            if r.success:
                r.retokenized_output_tokens = len(codec.encode(r.text))
    m = metrics.compute(results, duration)
    extra = {"Backend": args.backend, "Dataset": args.dataset_name, "Request rate": args.request_rate,
             "Max concurrency": args.max_concurrency or "-", "Model": cfg.model}  # fmt: skip
    if clock := gpu_clock.describe(gpu.summary):
        extra["GPU clock, power"] = clock
    print(report.table(m, extra={k: str(v) for k, v in extra.items()}))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"} | {"base_url": url, "model": cfg.model}
        report.write_json(args.out, report.results_json(config, models, started_at, m, results, gpu.summary))
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from loadgen.plot import plot

        plot(results, args.plot, title=f"loadgen {args.backend} {args.dataset_name} rate={args.request_rate} "
                                        f"max_concurrency={args.max_concurrency}")  # fmt: skip
        print(f"wrote {args.plot}", file=sys.stderr)
    return _verdict(results)


async def _benchmark(args, session, cfg, prompts, rng) -> tuple[list[RequestResult], float]:
    """Send the prompts (cycled when bounded by --duration); wait for every answer."""
    items = prompts if args.duration is None else itertools.islice(itertools.cycle(prompts), args.num_prompts)
    total = len(prompts) if args.duration is None else args.num_prompts
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=total, disable=args.disable_tqdm, file=sys.stderr, unit="req")
    results: list[RequestResult] = []

    async def one(p, i, t0):
        try:
            r = await send(args.backend, session, cfg, p, i, t0)
            results.append(r)
            bar.update(1)
        finally:
            if sem:
                sem.release()

    tasks = []
    t0 = time.perf_counter()
    async for i, p in paced(enumerate(items), args.request_rate, rng, duration=args.duration):
        if sem:
            await sem.acquire()
            if args.duration is not None and time.perf_counter() - t0 >= args.duration:
                sem.release()  # the concurrency limit held this arrival past the run's end: not sent
                break
        tasks.append(asyncio.create_task(one(p, i, t0)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return sorted(results, key=lambda r: r.index), duration


def _verdict(results: list[RequestResult]) -> int:
    """0 when every request completed; 1 when some failed; 2 when all did (with the reason)."""
    failed = [r for r in results if not r.success]
    if not failed:
        return 0
    lines = report.failure_summary(results)
    if len(failed) == len(results):
        print(f"error: all {len(results)} requests failed: {lines[0]}", file=sys.stderr)
        return 2
    print(f"warning: {len(failed)} of {len(results)} requests failed: " + "; ".join(lines), file=sys.stderr)
    return 1
