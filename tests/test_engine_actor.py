"""The scheduler actor's logic without Ray: AsyncEngine in a plain event loop.

Admission (count and projected KV demand), streaming order, and abort when a consumer
goes away, each checked against the engine's own state.
"""

from __future__ import annotations

import asyncio

import pytest

from _replica_client import generate
from pagedserve.cluster.replica.engine_replica import Admission, AsyncEngine
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.random_models import make_test_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "actor-models")


def _engine(model, **kw) -> AsyncEngine:
    cfg = dict(model=model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
               max_num_seqs=2)
    cfg.update(kw)
    return AsyncEngine(EngineConfig(**cfg))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _first(gen):
    return await gen.__anext__()


def test_stream_then_finish_and_count_admission(model):
    """max_num_seqs=2, max_waiting_requests=1: two run, one waits, the fourth is 429."""
    core = _engine(model, max_waiting_requests=1)

    async def scenario():
        gens = [generate(core, f"r{i}", [5 + i] * 8, _greedy(200)) for i in range(4)]
        adms = [await _first(g) for g in gens]
        assert [a.accepted for a in adms] == [True, True, True, False]
        assert adms[3].status == 429 and adms[3].retry_after_s == 1
        assert "max_waiting_requests=1" in adms[3].message
        # A short request streams its tokens in order and ends with finished=True.
        for g in gens[:3]:
            await g.aclose()  # consumers leave: the engine aborts them
        short = generate(core, "s", [7] * 8, _greedy(5))
        assert (await _first(short)).accepted
        tokens, finished = [], False
        async for out, _ in short:
            tokens = out.outputs[0].token_ids
            finished = out.finished
        assert finished and len(tokens) == 5

    asyncio.run(scenario())
    assert not core.engine.has_unfinished_requests()
    core.shutdown()


def test_projected_kv_demand_is_429(model):
    """A 64-block pool, max_num_seqs=1, no count limit: one request runs, 100-token
    prompts (7 blocks each) queue behind it until their prompts alone would need more
    blocks than the whole pool: 9 x 7 = 63 fit, a 10th (70 > 64) is 429. (The delay bound
    is off: before a drain rate is measured it would refuse the 2nd waiter of 1 slot.)"""
    core = _engine(model, max_num_seqs=1, max_queue_delay_s=None)

    async def scenario():
        running = generate(core, "run", [3] * 8, _greedy(240))
        assert (await _first(running)).accepted
        await running.__anext__()  # it has produced a token: it is running, not waiting
        waiting, adm = [], None
        for i in range(12):
            g = generate(core, f"w{i}", [9] * 100, _greedy(8))
            adm = await _first(g)
            if not adm.accepted:
                break
            waiting.append(g)
        # 9 waiting prompts hold 9 x 7 = 63 blocks; the 10th would need 70 > 64.
        assert len(waiting) == 9
        assert adm.status == 429 and "KV blocks" in adm.message
        for g in waiting + [running]:
            await g.aclose()

    asyncio.run(scenario())
    core.shutdown()


def test_bad_request_is_400_and_cancel_frees_blocks(model):
    core = _engine(model)

    async def scenario():
        bad = generate(core, "too-long", [5] * 300, _greedy(4))
        adm = await _first(bad)
        assert isinstance(adm, Admission) and adm.status == 400
        assert "maximum context length" in adm.message

        gen = generate(core, "long", [5] * 40, _greedy(200))
        assert (await _first(gen)).accepted

        started = asyncio.Event()
        received = []

        async def consume():
            async for item in gen:
                received.append(item)
                if len(received) == 5:
                    started.set()

        task = asyncio.create_task(consume())
        # Cancel mid-generation (a tiny model can finish 200 tokens in a fraction of a
        # second, so wait for tokens, not for a fixed time).
        await asyncio.wait_for(started.wait(), timeout=30)
        task.cancel()  # what Serve does when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):  # the abort lands before the next step
            await asyncio.sleep(0.02)
            if core.stats()["kv_cache_usage"] == 0:
                break
        assert core.stats()["kv_cache_usage"] == 0
        assert core.stats()["running"] == 0
        # Aborted, not finished: far fewer than the 200 requested tokens were generated.
        assert core.stats()["num_generation_tokens"] < 100

    asyncio.run(scenario())
    assert not core.engine.has_unfinished_requests()
    core.shutdown()


def test_a_replica_publishes_its_cached_prefixes_to_a_subscriber(model):
    """With kv_events_host (several replicas can run), the replica publishes its prefix
    cache's changes each step; a router's subscriber then holds exactly the cache's hashes
    and matches a later prompt's leading blocks as the replica's lookup does."""
    import time

    from pagedserve.cluster.wire.kv_events import KVEventSubscriber
    from pagedserve.scheduler.kv.kv_cache_utils import ROOT_HASH, hash_block_tokens

    core = AsyncEngine(EngineConfig(model=model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                                    max_num_seqs=2), kv_events_host="127.0.0.1")
    assert core.kv_events_address.startswith("tcp://127.0.0.1:")
    assert core.info()["kv_events"] == core.kv_events_address
    single = _engine(model)
    assert single.kv_events_address is None  # one replica: nothing published
    single.shutdown()
    sub = KVEventSubscriber(core.kv_events_address)
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16

    async def scenario():
        async for _ in generate(core, "a", prompt, _greedy(4)):
            pass
        pool = core.engine.scheduler.kv_cache_manager.block_pool
        cached = {b.block_hash for b in pool.cached_block_hash_to_block.values()}
        deadline = time.monotonic() + 10
        while sub.view.hashes != cached:  # the snapshot comes at an idle heartbeat at the latest
            assert time.monotonic() < deadline, (sub.view.seq, pool.kv_events.seq)
            sub.poll()
            await asyncio.sleep(0.05)
        return cached

    try:
        cached = asyncio.run(scenario())
    finally:
        sub.close()
        core.shutdown()
    h0 = hash_block_tokens(ROOT_HASH, tuple(prompt[:16]), None)
    h1 = hash_block_tokens(h0, tuple(prompt[16:32]), None)
    assert {h0, h1} <= cached
    assert sub.view.matched_blocks([h0, h1, hash_block_tokens(h1, (1,) * 16, None)]) == 2
