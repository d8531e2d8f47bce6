"""A dead tensor-parallel worker under load, on a real Serve app (TP=2, gloo on CPU).

The story, timed from the SIGKILL of one worker actor's process:
- the streams in flight end with an error within 2 s (in-band, their headers are gone);
- /health answers 503 in OpenAI's error JSON until the replica is replaced;
- Serve replaces the replica (a fresh placement group, two fresh workers) and
  completions succeed again within 60 s (the figure is printed);
- no process of the old replica is left: the other worker died with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from conftest import SERVE_ENGINE, delete_app

APP, PREFIX = "tp-kill-test", "/tpkill"


def worker_pids(raylet: int) -> set[int]:
    """Processes of TP worker actors (Ray titles them ``ray::RayWorkerWrapper...``) under
    ``raylet`` (another Ray on the machine, a script's private one, may run workers of its
    own meanwhile)."""
    pids = set()
    for child in psutil.Process(raylet).children():
        try:
            if " ".join(child.cmdline()).startswith("ray::RayWorkerWrapper"):
                pids.add(child.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return pids


def session_raylet() -> int:
    """The raylet of this session's Ray: ray.init() started it as a child of this process."""
    [raylet] = [p.pid for p in psutil.Process().children() if p.name() == "raylet"]
    return raylet


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def base(serve_url, serve_model):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    raylet = session_raylet()
    before = worker_pids(raylet)
    cfg = EngineConfig(model=serve_model, **{**SERVE_ENGINE, "tensor_parallel_size": 2,
                                             "max_waiting_requests": None})
    serve.run(build_app(cfg, name_prefix="tpkill-", engine_num_cpus=0.5), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX, worker_pids(raylet) - before, raylet
    delete_app(APP)


async def _stream(ac: httpx.AsyncClient, url: str, started: asyncio.Event) -> tuple[list[str], float]:
    body = {"prompt": "kill", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []
    async with ac.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line:
                lines.append(line)
                started.set()
    return lines, time.monotonic()


@pytest.mark.scenarios  # under -m scenarios (pyproject.toml), not the default run
def test_sigkill_one_worker_fails_in_flight_fast_and_serve_recovers(base):
    url, workers, raylet = base
    assert len(workers) == 2, workers
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200

    async def kill_under_load():
        async with httpx.AsyncClient(timeout=60) as ac:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(_stream(ac, f"{url}/v1/completions", e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            victim = max(workers)
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*streams), 30)
            health = await ac.get(f"{url}/health")
            return t_kill, ends, health

    t_kill, ends, health = asyncio.run(kill_under_load())
    for lines, t_end in ends:
        assert '"error"' in lines[-2], lines[-3:]  # the in-band error (headers are gone)
        assert t_end - t_kill < 2.0, t_end - t_kill
        print(f"\nin-flight stream ended with an error {t_end - t_kill:.2f} s after the kill")
    assert health.status_code == 503, health.text
    assert health.json()["error"]["code"] == 503

    # Recovery: the first completion that succeeds after the kill.
    deadline = t_kill + 60
    recovered = None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=10,
                           json={"prompt": "back", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                recovered = time.monotonic() - t_kill
                break
            assert r.status_code == 503, r.text  # refused by the dead replica, never hung
        except httpx.TimeoutException:
            pass
        time.sleep(0.5)
    assert recovered is not None, "no successful completion within 60 s of the kill"
    print(f"\nTP=2 worker SIGKILL: first successful completion {recovered:.1f} s after the kill")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200

    # The old replica's other worker is gone too (it died with its owner), and the
    # new replica runs two fresh workers.
    deadline = time.monotonic() + 20
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in workers), [p for p in workers if alive(p)]
    fresh = {p for p in worker_pids(raylet) if alive(p)} - workers
    assert len(fresh) == 2, fresh
