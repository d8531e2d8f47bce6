"""The body of a streamed response (completions and chat alike): the engine streams'
outputs as OpenAI SSE chunks (openai_format.StreamState), then the usage chunk when asked,
then ``data: [DONE]``.

The 200 and its headers are gone before the first chunk, so a failure from here on is
reported in-band, as vLLM does: a replica lost after tokens were sent (the request cannot
move: failover.Resumable) is an error chunk with 503 naming the replica, any other failure
one with 500, logged with the request id. A client that leaves closes this generator at a
yield: the streams that have not finished are cancelled then (merged_streams.py), which
aborts their requests in the engine. However it ends, the request leaves the live list.
"""

from __future__ import annotations

import logging
from contextlib import aclosing

from pagedserve.cluster.front.openai import openai_format as fmt
from pagedserve.cluster.front.door import LiveRequests
from pagedserve.cluster.front.merged_streams import merged
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.wire.failures import ReplicaLost

logger = logging.getLogger("pagedserve")


async def sse_events(streams: list, state: fmt.StreamState, include_usage: bool, model: ServedModel,
                     live: LiveRequests, shapers: list | None = None):
    """SSE lines of the response ``state`` describes. ``shapers``: per stream, what turns its
    outputs into the response's choices (openai_format.ChoiceShaper; None: as they come).
    Each stream that ends unfinished counts as an abort in /metrics (one per engine request,
    as vLLM counts them)."""
    finished = [False] * len(streams)
    finals: list = [None] * len(streams)
    try:
        try:
            # aclosing: a client that leaves closes this generator at a yield; the merge
            # must then cancel the unfinished streams now, not when it is collected.
            async with aclosing(merged(streams, finished)) as items:
                async for i, (out, tt) in items:
                    finals[i] = shaped = out if shapers is None else shapers[i].shape(out)
                    for line in state.chunks(shaped, tt or {}):
                        yield line
        except ReplicaLost as e:  # tokens were sent: it cannot move (Resumable)
            logger.warning("request %s: %s mid-stream", state.rid, e)
            for line in fmt.sse_failure(state.rid, 503, f"{e}; request {state.rid} ended mid-stream"):
                yield line
            return
        except Exception:  # headers are gone: report in-band, as vLLM does
            logger.exception("request %s failed mid-stream", state.rid)
            for line in fmt.sse_failure(state.rid):
                yield line
            return
        if include_usage and None not in finals:
            yield state.usage_chunk(fmt.combined(state.rid, finals))
        yield fmt.SSE_DONE
        for out in finals:
            model.observe(out)
    finally:
        live.release(state.rid)
        model.observe_abort(finished.count(False))
