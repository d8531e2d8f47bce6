"""A replica's lifeline (cluster/wire/lifeline.py) and the placement check, without a cluster:
the front learns of a dead replica process at once, of a silent one after SILENCE_S, and
not at all of a live one; a placement group that fits no node is refused with the numbers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pagedserve.cluster.wire import lifeline
from pagedserve.cluster.wire.lifeline import Lifeline, LifelineWatch

CHILD = ("import sys, time\n"
         "from pagedserve.cluster.wire.lifeline import Lifeline\n"
         "line = Lifeline('127.0.0.1')\n"
         "print(line.address, flush=True)\n"
         "time.sleep(600)\n")


async def _watch(address: str, seconds: float):
    lost = asyncio.get_running_loop().create_future()
    watch = LifelineWatch("r1", address, lambda rid, why: lost.done() or lost.set_result((rid, why, time.monotonic())))
    try:
        return await asyncio.wait_for(lost, seconds)
    except asyncio.TimeoutError:
        return None
    finally:
        watch.close()


def test_a_killed_replica_process_is_lost_at_once():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()

        async def scenario():
            lost = asyncio.get_running_loop().create_future()
            watch = LifelineWatch("r1", address, lambda rid, why: lost.set_result((rid, why, time.monotonic())))
            await asyncio.sleep(1.0)  # beats come: still alive
            assert not lost.done()
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            rid, why, t = await asyncio.wait_for(lost, 5)
            watch.close()
            return rid, why, t - t0

        rid, why, after = asyncio.run(scenario())
        assert rid == "r1" and "gone" in why and after < 0.5
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_peer_is_lost_after_the_silence_and_a_live_one_never():
    live = Lifeline("127.0.0.1")
    mute = socket.create_server(("127.0.0.1", 0))  # accepts, never beats (a machine gone)
    try:
        assert asyncio.run(_watch(live.address, lifeline.SILENCE_S + 1.0)) is None
        t0 = time.monotonic()
        rid, why, t = asyncio.run(_watch(f"127.0.0.1:{mute.getsockname()[1]}", lifeline.SILENCE_S + 3.0))
        assert "nothing from it" in why and lifeline.SILENCE_S <= t - t0 < lifeline.SILENCE_S + 1.0
        # A replica that leaves on purpose closes its line: its fronts see it at once.
        async def closing():
            task = asyncio.ensure_future(_watch(live.address, 3.0))
            await asyncio.sleep(0.5)
            live.close()
            return await task
        rid, why, _ = asyncio.run(closing())
        assert "gone" in why
    finally:
        live.close()
        mute.close()


def test_a_group_that_fits_no_node_is_refused_with_its_size_and_the_largest_node(monkeypatch):
    from pagedserve.cluster import placement
    from pagedserve.config import EngineConfig

    nodes = [{"Alive": True, "Resources": {"CPU": 0.0}}, {"Alive": True, "Resources": {"CPU": 48.0, "GPU": 4.0}},
             {"Alive": True, "Resources": {"CPU": 48.0, "GPU": 4.0}}]
    monkeypatch.setattr(placement, "alive_nodes", lambda: nodes)
    monkeypatch.setattr(placement, "node_types", lambda: {})  # a fixed cluster: no autoscaler

    def group(tp):
        return placement.engine_bundles(EngineConfig(tensor_parallel_size=tp, device="cuda"), replica_cpus=0.5)

    with pytest.raises(ValueError) as e:
        placement.check_group_fits(group(8), "STRICT_PACK")
    msg = str(e.value)
    assert "needs CPU 8.5, GPU 8 on one node" in msg and "largest of the 3 live nodes has CPU 48, GPU 4" in msg
    assert "--placement-group-strategy PACK" in msg
    placement.check_group_fits(group(8), "PACK")  # spans the two nodes: allowed when asked
    placement.check_group_fits(group(4), "STRICT_PACK")
    with pytest.raises(ValueError, match="the whole cluster has"):
        placement.check_group_fits(group(12), "PACK")


def test_control_sockets_bind_loopback_on_a_one_node_cluster(ray_session):
    from pagedserve.cluster.ray_utils import bind_host

    assert bind_host() == "127.0.0.1"
