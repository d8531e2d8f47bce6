"""Flow control on the engine -> ingress stream (cluster/ray_utils.py
stream_with_backpressure): a reader that falls behind gets the steps it missed merged into
few items, with every token in order, instead of one queued Ray object per token."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.ray_utils import _BackpressuredMethod


class _Method:
    def __init__(self):
        self.seen = None

    def options(self, **kw):
        self.seen = kw
        return self


def test_only_streaming_calls_get_flow_control():
    m = _Method()
    _BackpressuredMethod(m, 1).options(num_returns="streaming")
    assert m.seen == {"num_returns": "streaming", "_generator_backpressure_num_objects": 1}
    _BackpressuredMethod(m, 1).options(num_returns=1)
    assert m.seen == {"num_returns": 1}


def test_a_slow_reader_gets_merged_items_with_every_token(openai_app):
    from ray import serve

    from pagedserve.scheduler import SamplingParams

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Reader:
        """Reads an engine stream from inside a Serve replica, as the ingress does."""

        def __init__(self):
            from pagedserve.cluster.ray_utils import stream_with_backpressure

            stream_with_backpressure()
            self.engine = serve.get_deployment_handle("EngineDeployment", "openai-test").options(stream=True)

        async def read(self, rid, prompt, params, pause_s):
            gen = self.engine.generate.remote(rid, prompt, params)
            adm = await gen.__anext__()
            assert adm.accepted, adm.message
            await asyncio.sleep(pause_s)  # a busy ingress
            items, ids = 0, []
            async for out, _texts in gen:
                items += 1
                ids = list(out.outputs[0].token_ids)  # cumulative, as the ingress accumulates
                if out.finished:
                    break
            return items, ids

    reader = serve.run(Reader.bind(), name="flow-reader", route_prefix=None)
    try:
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        prompt = [11, 12, 13, 14, 15, 16, 17]
        fast_items, fast_ids = reader.read.remote("flow-fast", prompt, params, 0.0).result()
        slow_items, slow_ids = reader.read.remote("flow-slow", prompt, params, 2.0).result()
    finally:
        serve.delete("flow-reader")
    assert len(fast_ids) == len(slow_ids) == 48
    assert slow_ids == fast_ids  # greedy: the same tokens, merged or not
    # The engine ran all 48 steps while the reader slept: with flow control they waited in
    # the engine and left as ~1 item; without, 48 objects were queued at the reader.
    assert slow_items <= 4, slow_items
    assert fast_items > slow_items
