"""The engine streams of one response read as one: a batch of prompts (/v1/completions)
is one engine request per prompt, and its answer takes their outputs as they come.

    stream 0 ─┐
    stream 1 ─┼─▶ (prompt index, (RequestOutput, token_text)), in arrival order
    stream 2 ─┘

Every way out (the reader closes it, a stream fails, the task is cancelled) cancels the
streams that have not finished, so no prompt keeps its blocks in the engine. ``finished``
is the caller's: what each stream's last output said, read by the caller after the end.
"""

from __future__ import annotations

import asyncio

_END = object()


async def merged(streams, finished: list[bool]):
    """(prompt index, (RequestOutput, token_text)) from every stream, as they come."""
    if len(streams) == 1:
        # One prompt: read it as the caller reads, with no pump in between: the steps its
        # reader missed come merged into one item (ChannelStream).
        try:
            async for item in streams[0]:
                finished[0] = item[0].finished
                yield 0, item
        finally:
            if not finished[0]:
                streams[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except BaseException as e:  # re-raised by the consumer, which would wait forever else
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            finished[i] = item[0].finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s, done in zip(streams, finished):
            if not done:
                s.cancel()  # the engine aborts that prompt's request
