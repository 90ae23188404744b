"""Stopping a server as docker, systemd and a person at a terminal do: SIGTERM to the main process drains
(requests that can finish in --shutdown-timeout finish, the rest end with one final 503 event, then
`[DONE]`); Ctrl-C (SIGINT to the whole process group) does the same without a traceback or an "engine
failed"; a Ctrl-C during start-up stops the engine being started. Every time: exit code 0, no child
process left, no socket directory left in the temp folder."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import aiohttp
import psutil

from loadgen.launch import conduit_serve, free_port


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _gone(procs: list[psutil.Process]) -> bool:
    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs)


def _assert_clean_exit(server, children: list[psutil.Process], tmp) -> str:
    assert server.proc.wait(60) == 0
    assert _gone(children), [p.pid for p in children if p.is_running()]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("conduit-")]
    log = server.log()
    assert "Traceback" not in log and "engine_failed" not in log and "node_died" not in log, log[-3000:]
    return log


async def _sse(session: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event) -> list[dict]:
    """Every `data:` event of a stream (`[DONE]` as {"done": True}); `started` is set at the first one."""
    events: list[dict] = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def test_sigterm_drains_finishes_short_streams_and_fails_long_ones_once(launch_server, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with launch_server("--shutdown-timeout", "15", env={"TMPDIR": str(tmp)}) as server:
        children = _children(server.proc.pid)
        assert children and [p.name for p in tmp.iterdir() if p.name.startswith("conduit-")]

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                started = [asyncio.Event() for _ in range(2)]
                short = asyncio.create_task(
                    _sse(s, server.url, {"prompt": "One", "max_tokens": 6, "ignore_eos": True}, started[0])
                )
                long = asyncio.create_task(
                    _sse(s, server.url, {"prompt": "Two", "max_tokens": 4000, "ignore_eos": True}, started[1])
                )
                ws = await s.ws_connect(f"{server.url}/v1/ws")
                await ws.send_json(
                    {
                        "type": "generate",
                        "id": "w",
                        "endpoint": "completions",
                        "request": {"prompt": "Three", "max_tokens": 4000, "ignore_eos": True},
                    }
                )
                assert (await ws.receive_json(timeout=60))["type"] == "delta"
                await asyncio.gather(*(e.wait() for e in started))
                server.proc.send_signal(signal.SIGTERM)  # the main process only, as docker stop does
                # the drain has begun once /health says so (or the port is closed already)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        async with s.get(f"{server.url}/health") as h:
                            if h.status == 503:
                                assert (await h.json())["status"] == "shutting_down"
                                break
                    except aiohttp.ClientConnectionError:
                        break
                ws_frames = []
                async for msg in ws:
                    ws_frames.append(json.loads(msg.data))
                return await short, await long, ws_frames

        short, long, ws_frames = asyncio.run(main())
        assert short[-1] == {"done": True} and short[-2]["choices"][0]["finish_reason"] == "length"
        assert long[-1] == {"done": True}
        errors = [e for e in long if "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "shutting_down", long[-3:]
        finals = [f for f in ws_frames if f["type"] in ("done", "error")]
        assert len(finals) == 1 and finals[0]["type"] == "error", ws_frames[-3:]
        assert finals[0]["error"]["code"] == "shutting_down"
        log = _assert_clean_exit(server, children, tmp)
        assert "drain_deadline" in log


def test_ctrl_c_with_a_stream_in_flight_lets_it_finish_without_a_traceback(launch_server, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # a drain long enough for a loaded CI machine: the stream finishes, it is not cut at the deadline
    with launch_server("--shutdown-timeout", "60", env={"TMPDIR": str(tmp)}) as server:
        children = _children(server.proc.pid)

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                started = asyncio.Event()
                body = {"prompt": "Count", "max_tokens": 8, "ignore_eos": True}
                stream = asyncio.create_task(_sse(s, server.url, body, started))
                await started.wait()
                os.killpg(server.proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
                return await stream

        events = asyncio.run(main())
        assert events[-1] == {"done": True}
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert not [e for e in events if "error" in e]
        _assert_clean_exit(server, children, tmp)


def test_ctrl_c_during_start_up_stops_the_engine_and_leaves_nothing(smollm2_path, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            conduit_serve(free_port()),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
    try:
        # the socket directory exists once the engine process is being started
        deadline = time.monotonic() + 120
        while not [p for p in tmp.iterdir() if p.name.startswith("conduit-")]:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)  # polling for a process we do not control; there is no event to wait on
        children = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert _gone(children)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("conduit-")]
    text = log_path.read_text()
    assert "Traceback" not in text and "stopped_during_start_up" in text, text[-3000:]
