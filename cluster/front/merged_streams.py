"""The engine streams of one response read as one: a batch of prompts (/v1/completions,
/v1/embeddings) is one engine request per prompt, admitted together (``start_all``: one
refused, the others are cancelled and that answer is the response), and its answer takes
their outputs as they come (``merged``).

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


async def start_all(client, reqs: list, *, whole: bool, arrival: float | None, ids_shown: bool):
    """Admit every request of a batch through ``client`` (a ReplicaClient), concurrently;
    (streams, admissions), or (None, the first refusal's error response) with the admitted
    ones cancelled. A client that leaves meanwhile cancels them all."""
    tasks = [asyncio.ensure_future(client.generate(req, whole=whole, arrival=arrival, ids_shown=ids_shown))
             for req in reqs]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:  # the client left while we were admitting
        _drop(tasks)
        raise
    results = [t.result() if not t.exception() else (None, t.exception()) for t in tasks]
    refused = [r for s, r in results if s is None]
    if not refused:
        return [s for s, _ in results], [a for _, a in results]
    for s, _ in results:
        if s is not None:
            s.cancel()
    if isinstance(refused[0], BaseException):
        raise refused[0]
    return None, refused[0]


def _drop(tasks) -> None:
    """Cancel the admissions of a batch whose client left, and the streams already admitted."""
    for t in tasks:
        if not t.done():
            t.cancel()  # ReplicaClient.generate cancels its own stream
        elif not t.cancelled() and t.exception() is None and t.result()[0] is not None:
            t.result()[0].cancel()
