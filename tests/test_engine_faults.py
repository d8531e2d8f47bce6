"""The scheduler actor's failure handling without Ray: AsyncEngine in a plain event loop.

- a request that fails on its own raises RequestFailed to its caller only, while another
  request streams on with exactly its tokens; max_num_seqs + 1 of them leave it serving;
- a step that raises with a request in it is re-run in parts: that request fails alone;
- a worker that cannot compute (no part of the batch and no probe succeeds) fails every
  open request at once, marks the engine dead (check_health raises, new requests get
  503) and stops the loop: no spinning;
- a 20 MB prompt is refused at once and never delays the step of a running request.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from _replica_client import generate
from fault_plugin import PLUGINS_ENV, PLUGIN_PATH, marker
from pagedserve.cluster.replica.engine_replica import AsyncEngine
from pagedserve.cluster.wire.failures import EngineDeadError, RequestFailed
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.random_models import make_test_model

MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "fault-models")


@pytest.fixture
def core(model, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, PLUGIN_PATH)
    engine = AsyncEngine(EngineConfig(model=model, dtype="float32", max_model_len=256,
                                      num_gpu_blocks_override=64, max_num_seqs=MAX_NUM_SEQS))
    yield engine
    engine.shutdown()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def _collect(gen) -> list[int]:
    adm = await gen.__anext__()
    assert adm.accepted, adm.message
    tokens = []
    async for out, _ in gen:
        tokens = out.outputs[0].token_ids
    return tokens


async def _wait_idle(core, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = core.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_cache_usage"] == 0:
            break
        await asyncio.sleep(0.05)
    return core.stats()


@pytest.mark.parametrize("site", ["setup", "sample", "detokenize", "step"])
def test_a_failing_request_fails_alone_while_another_streams(core, site):
    async def scenario():
        alone = await _collect(generate(core, "ref", [5] * 8, _greedy(40)))
        other = asyncio.create_task(_collect(generate(core, "other", [5] * 8, _greedy(40))))
        await asyncio.sleep(0.05)  # the other one is in the batch before the poisons come
        # max_num_seqs + 1 poisons, one after another: none may stick in the batch.
        for i in range(MAX_NUM_SEQS + 1):
            poison = generate(core, f"p{i}", [7] * 8, _greedy(8, stop=[marker(site)]))
            with pytest.raises(RequestFailed, match="InjectedFault"):
                await _collect(poison)
        assert await other == alone
        stats = await _wait_idle(core)
        assert stats["running"] == 0 and stats["kv_cache_usage"] == 0
        assert await _collect(generate(core, "after", [9] * 8, _greedy(5))) != []  # still serving
        await core.check_health()

    asyncio.run(scenario())


def test_a_broken_worker_fails_everyone_once_and_the_engine_goes_quiet(core):
    async def scenario():
        streams = [asyncio.create_task(_collect(generate(core, f"s{i}", [5 + i] * 8, _greedy(240))))
                   for i in range(MAX_NUM_SEQS - 1)]  # room left for the poison to join them
        # The poison comes once the streams run (a fixed sleep let a fast machine finish
        # all 240 tokens first): they are far from done when it joins the next step.
        deadline = time.monotonic() + 5
        while core.stats()["running"] < MAX_NUM_SEQS - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        poison = asyncio.create_task(_collect(generate(core, "p", [7] * 8,
                                                            _greedy(8, stop=[marker("broken")]))))
        results = await asyncio.wait_for(asyncio.gather(*streams, poison, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError, match="InjectedFault"):
            await core.check_health()
        late = generate(core, "late", [5] * 8, _greedy(4))
        adm = await late.__anext__()
        assert not adm.accepted and adm.status == 503
        stats = await _wait_idle(core)
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_usage"] == 0
        # Idle and dead: the loop has stopped, it does not retry the step in a hot loop
        # (it used to, at 100% CPU). 1.5 s of wall time must cost far less than 1.5 s of CPU.
        cpu0 = time.process_time()
        await asyncio.sleep(1.5)
        assert time.process_time() - cpu0 < 0.5

    asyncio.run(scenario())


def test_a_20_mb_prompt_is_refused_at_once_and_delays_no_step(core):
    huge = "a" * (20 << 20)

    async def scenario():
        gaps, last = [], None

        async def stream():
            nonlocal last
            gen = generate(core, "s", [5] * 8, _greedy(240))
            assert (await gen.__anext__()).accepted
            async for _ in gen:
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now

        task = asyncio.create_task(stream())
        while last is None:
            await asyncio.sleep(0.01)
        for kind in ("prompt", "messages"):
            t0 = time.monotonic()
            gen = generate(core, f"huge-{kind}", huge if kind == "prompt" else None, _greedy(4),
                                messages=[{"role": "user", "content": huge}] if kind == "messages" else None)
            adm = await gen.__anext__()
            took = time.monotonic() - t0
            assert adm.status == 400 and "maximum context length" in adm.message, adm.message
            assert took < 1.0, took  # tokenizing it would take ~25 s
        with pytest.raises(ValueError, match="characters"):
            await core.tokenize(huge)
        await task
        # Tokenizing 20 MB on the engine thread stalled every step for its duration.
        assert max(gaps) < 1.0, max(gaps)

    asyncio.run(scenario())
