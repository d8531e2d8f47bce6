"""The engine -> ingress output channel (cluster/wire/output_channel.py) on real ZeroMQ
sockets on 127.0.0.1, without Ray: the channel alone, then AsyncEngine sending to it.

The engine's Ray stream is stood in for by ``Lifeline`` (tests/_replica_client.py): the
generator AsyncEngine.generate returns (what Serve streams), with ``cancel()`` cancelling the
task that reads it, as cancelling a Serve response does to the replica's generator."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import zmq

from _replica_client import Lifeline as _Lifeline
from pagedserve import LLM
from pagedserve.cluster.wire import output_channel
from pagedserve.cluster.replica.engine_replica import AsyncEngine
from pagedserve.cluster.wire.failures import RequestFailed
from pagedserve.cluster.wire.output_channel import ChannelSender, OutputChannel
from pagedserve.cluster.wire.stream import Accumulated, slim
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.random_models import make_test_model


async def _ended():
    return
    yield  # an async generator that ends at once: the engine's stream after its final output


def _out(rid: str, ids: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(index=0, text="".join(f"<{i}>" for i in ids), token_ids=list(ids),
                         finish_reason="length" if finished else None)
    return RequestOutput(rid, "p", [1, 2, 3], [c], finished=finished)


def _step(rid: str, ids: list[int], new: list[int], first: bool, finished: bool = False):
    """The wire item of one step that added ``new`` to ``ids``."""
    out = _out(rid, ids + new, finished)
    out.outputs[0].delta_text = "".join(f"<{i}>" for i in new)
    out.outputs[0].delta_token_ids = list(new)
    return slim(out, first), None


async def _wait_until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_slow_reader_gets_the_steps_it_missed_as_one_item_and_a_late_final_output():
    """Three steps in three messages, read after all came: one item with every token, the
    prompt ids of the first, the final output whole. The Ray stream had ended before."""

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        sender = ChannelSender()
        addr, key = ch.route
        stream = Accumulated(ch.open("r").attach(_ended()))
        sender.send(addr, key, [("r", _step("r", [], [7, 8], first=True)), ("other", _step("other", [], [1], True))])
        sender.send(addr, key, [("r", _step("r", [7, 8], [9], first=False))])
        await asyncio.sleep(0.2)  # the reader is busy; the Ray stream has ended meanwhile
        sender.send(addr, key, [("r", _step("r", [7, 8, 9], [10], first=False, finished=True))])
        await asyncio.sleep(0.2)
        items = [item async for item in stream]
        assert len(items) == 1
        out = items[0][0]
        assert out.finished and out.outputs[0].token_ids == [7, 8, 9, 10]
        assert out.outputs[0].delta_token_ids == [7, 8, 9, 10]  # every step's delta, in order
        assert out.outputs[0].delta_text == "<7><8><9><10>"
        assert out.prompt_token_ids == [1, 2, 3]
        ch.close()
        sender.close()

    asyncio.run(scenario())


def test_a_message_without_the_ingress_key_is_dropped_unread():
    """Whoever reaches the port without the key gets nothing unpickled: the message is
    counted and dropped, and the stream goes on with the engine's messages."""

    class Bomb:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled a stranger')",))

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        addr, key = ch.route
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.PUSH)
        stranger.connect(addr)
        stranger.send_multipart([b"\0" * 32, pickle.dumps([("r", Bomb())])])
        stranger.send(b"one frame")
        stream = Accumulated(ch.open("r").attach(_ended()))
        await _wait_until(lambda: ch.rejected == 2)
        sender = ChannelSender()
        sender.send(addr, key, [("r", _step("r", [], [4], first=True, finished=True))])
        items = [item async for item in stream]
        assert [o.outputs[0].token_ids for o, _ in items] == [[4]]
        stranger.close(linger=0)
        ctx.term()
        ch.close()
        sender.close()

    asyncio.run(scenario())


def test_a_failure_on_the_ray_stream_comes_after_the_outputs_before_it():
    async def failing():
        await asyncio.sleep(0.1)
        raise RequestFailed("request r failed: boom")
        yield

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        sender = ChannelSender()
        stream = ch.open("r").attach(failing())
        sender.send(*ch.route, [("r", _step("r", [], [5], first=True))])
        await asyncio.sleep(0.3)  # both are there when the reader comes
        first = await stream.__anext__()
        assert first[0].outputs[0].delta_token_ids == [5]
        with pytest.raises(RequestFailed, match="boom"):
            await stream.__anext__()
        sender.send(*ch.route, [("r", _step("r", [5], [6], first=False))])  # dropped: closed
        await asyncio.sleep(0.1)
        assert "r" not in ch._streams
        ch.close()
        sender.close()

    asyncio.run(scenario())


def test_a_final_output_that_never_comes_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(output_channel, "FINAL_GRACE_S", 0.2)

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        stream = ch.open("r").attach(_ended())
        with pytest.raises(RuntimeError, match="final output never came"):
            await asyncio.wait_for(stream.__anext__(), 5)
        ch.close()

    asyncio.run(scenario())


def test_the_sender_reports_an_ingress_that_stopped_reading(monkeypatch):
    """Nobody reads the address: SEND_HWM messages queue, the next send is refused at once."""
    monkeypatch.setattr(output_channel, "SEND_HWM", 3)
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    sender = ChannelSender()
    sent = [sender.send(f"tcp://127.0.0.1:{port}", b"k", [("r", i)]) for i in range(6)]
    assert sent[:3] == [True] * 3 and not any(sent[4:])
    sender.close()


# ------------------------------------------------------------------ with the engine
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "channel-models")


def _engine(model) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=model, dtype="float32", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=4))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _over_channel(core, ch, rid, prompt, params):
    """(Accumulated stream over the channel, admission), as ReplicaClient.generate opens one."""
    sub = ch.open(rid)
    gen = core.generate(EngineRequest(rid, prompt, params), output_route=ch.route)
    adm = await gen.__anext__()
    assert adm.accepted, adm.message
    return Accumulated(sub.attach(_Lifeline(gen))), adm


def test_engine_outputs_over_the_channel_equal_the_offline_engine(model):
    """Greedy: the offline engine's tokens and text; a reader that sleeps through the whole
    request gets it as one item; the engine's stream carries nothing after the Admission."""
    prompt = [11, 12, 13, 14, 15, 16, 17]
    llm = LLM(model=model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    try:
        offline = llm.generate([prompt], _greedy(24), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    core = _engine(model)

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        fast, adm = await _over_channel(core, ch, "fast", prompt, _greedy(24))
        assert adm.prompt_token_ids == prompt
        fast_items = [out async for out, _ in fast]
        slow, _ = await _over_channel(core, ch, "slow", prompt, _greedy(24))
        await _wait_until(lambda: not core.engine.has_unfinished_requests())
        await asyncio.sleep(0.1)
        slow_items = [out async for out, _ in slow]
        ch.close()
        return [offline], fast_items, slow_items

    ref_items, fast_items, slow_items = asyncio.run(scenario())
    core.shutdown()
    want = ref_items[-1].outputs[0]
    assert len(want.token_ids) == 24
    for items in (fast_items, slow_items):
        got = items[-1]
        assert got.finished and got.outputs[0].token_ids == want.token_ids
        assert got.outputs[0].text == want.text
        assert got.prompt_token_ids == [11, 12, 13, 14, 15, 16, 17]
        # Deltas add up to the whole, as the SSE chunks the ingress makes of them.
        assert [t for o in items for t in o.outputs[0].delta_token_ids] == want.token_ids
    assert len(fast_items) > 1 and len(slow_items) == 1


def test_cancelling_a_channel_request_aborts_it_and_frees_its_blocks(model):
    core = _engine(model)

    async def scenario():
        ch = OutputChannel("127.0.0.1")
        stream, _ = await _over_channel(core, ch, "long", [5] * 40, _greedy(200))
        got = 0
        async for out, _ in stream:
            got = len(out.outputs[0].token_ids)
            if got >= 3:
                break
        stream.cancel()  # the client went away
        await _wait_until(lambda: core.stats()["running"] == 0 and core.stats()["kv_cache_usage"] == 0)
        assert core.stats()["num_generation_tokens"] < 100
        ch.close()

    asyncio.run(scenario())
    core.shutdown()


def test_an_ingress_that_stops_reading_fails_its_requests_and_frees_their_blocks(model, monkeypatch):
    """Outputs routed to an address nobody reads: after SEND_HWM steps the engine fails
    the request on its stream (RequestFailed) and aborts it; nothing is held."""
    monkeypatch.setattr(output_channel, "SEND_HWM", 2)
    core = _engine(model)
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")

    async def scenario():
        gen = core.generate(EngineRequest("lost", [5] * 20, _greedy(200)), output_route=(f"tcp://127.0.0.1:{port}", b"k"))
        assert (await gen.__anext__()).accepted
        with pytest.raises(RequestFailed, match="stopped reading"):
            async for _ in gen:
                pass
        await _wait_until(lambda: core.stats()["running"] == 0 and core.stats()["kv_cache_usage"] == 0)
        assert core.stats()["num_generation_tokens"] < 20

    asyncio.run(scenario())
    core.shutdown()
