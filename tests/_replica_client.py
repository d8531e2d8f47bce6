"""What the ingress does with an engine replica, without Ray or Serve: open the request's
stream on an output channel (real ZeroMQ on 127.0.0.1), call ``AsyncEngine.generate`` with
its route, read the Admission from the generator (the request's lifeline, what Serve streams),
then the outputs from the channel with their cumulative fields rebuilt (``Accumulated``), as
``ReplicaClient.generate`` (cluster/front/replica_client.py) does.

``generate(core, rid, prompt, params, **kw)`` yields the Admission, then (RequestOutput,
token_text) items; closing it early cancels the lifeline, as a client that goes away does,
and returns once the engine has seen it.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

from pagedserve.cluster.wire.output_channel import OutputChannel
from pagedserve.cluster.wire.stream import Accumulated
from pagedserve.cluster.wire.request import EngineRequest

_channels: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OutputChannel]" = weakref.WeakKeyDictionary()


class Lifeline:
    """The generator AsyncEngine.generate returns, read as Serve's stream is: ``cancel()``
    cancels the task that reads it, as cancelling a Serve response does to the replica's
    generator (its ``finally`` aborts the request)."""

    def __init__(self, gen) -> None:
        self.gen, self.task, self.cancelled = gen, None, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.task = asyncio.ensure_future(self.gen.__anext__())
        return await self.task

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()

    async def closed(self) -> None:
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await self.task


def channel() -> OutputChannel:
    """This event loop's channel (one per ingress replica in production); closed with the loop."""
    loop = asyncio.get_running_loop()
    ch = _channels.get(loop)
    if ch is None:
        ch = _channels[loop] = OutputChannel("127.0.0.1")
        weakref.finalize(loop, _close_quietly, ch)
    return ch


def _close_quietly(ch: OutputChannel) -> None:
    with contextlib.suppress(Exception):
        ch.close()


async def generate(core, request_id: str, prompt, params, **kw):
    ch = channel()
    sub = ch.open(request_id)
    life = Lifeline(core.generate(EngineRequest(request_id, prompt, params, **kw), output_route=ch.route))
    try:
        adm = await life.__anext__()
    except BaseException:
        sub.close()
        raise
    yield adm
    if not adm.accepted:
        sub.close()
        return
    stream = Accumulated(sub.attach(life))
    finished = False
    try:
        async for item in stream:
            finished = item[0].finished
            yield item
        finished = True
    finally:
        if not finished:  # closed early, cancelled, or failed: the engine aborts it
            stream.cancel()
            await life.closed()
