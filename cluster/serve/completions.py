"""/v1/completions: one engine request per prompt of a batch, answered as one response.

    prompt: [p0, p1, p2] ──▶ engine.generate(rid-0, p0) ─┐  each admitted on its own;
                        ──▶ engine.generate(rid-1, p1) ─┼─ one refused (400/429): the
                        ──▶ engine.generate(rid-2, p2) ─┘  others are cancelled, that answer
                                        │ merged as they come: (prompt index, output)
                                        ▼
                        choices i * n + j (completion_format.py); one JSON body, or SSE
                        with one [DONE] and, with include_usage, usage summed over prompts

A single prompt keeps the request id as its engine id. Every way out (client gone,
the SSE generator closed, a failure) cancels the engine streams that have not
finished, so no prompt of a batch keeps its blocks.
"""

import asyncio
import logging
import time
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.serve import openai_format as fmt
from pagedserve.cluster.serve.completion_format import ChoiceShaper, batch_response, combined
from pagedserve.cluster.serve.edge import error
from pagedserve.cluster.serve.request_status import queue_header
from pagedserve.scheduler.vocab_limits import check_vocab_limits

logger = logging.getLogger("pagedserve")
_END = object()


async def _start_all(ingress, rid: str, prompts: list, params, body, tenant):
    """Admit every prompt (concurrently); (streams, admissions) or (None, error response)."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    tasks = [asyncio.ensure_future(ingress._start(sub, p, params, body, None, tenant))
             for sub, p in zip(ids, prompts)]
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
    for t in tasks:
        if not t.done():
            t.cancel()  # _start cancels its own stream
        elif not t.cancelled() and t.exception() is None and t.result()[0] is not None:
            t.result()[0].cancel()


async def _merged(streams, finished: list[bool]):
    """(prompt index, (RequestOutput, token_text)) from every stream, as they come."""
    if len(streams) == 1:
        # One prompt: read it as the caller reads, with no pump in between, so the engine
        # sees this reader's pace (flow control: ray_utils.stream_with_backpressure).
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


async def create_completion(ingress, body, rid: str, tenant):
    """The /v1/completions handler body (OpenAIIngress._generate_as for non-chat)."""
    bad = await ingress._check_model(body.model)
    if bad is not None:
        return bad
    info = await ingress.info()
    try:
        # Checked here too (the engine checks again) to name the field as it was sent.
        params = check_vocab_limits(body.to_sampling_params(), info["vocab_size"], info["max_logprobs"],
                                    "logprobs")
        prompts = body.prompts()
    except ValueError as e:
        return error(400, str(e))
    model = info["served_model_name"]
    created = int(time.time())
    streams, adms = await _start_all(ingress, rid, prompts, params, body, tenant)
    if streams is None:
        return adms
    ingress._live.placed(rid, adms[0].replica_id)
    headers = {"x-pagedserve-replica": adms[0].replica_id, "x-pagedserve-request-id": rid}
    queued = queue_header(adms[0].queue)
    if queued is not None:
        headers["x-pagedserve-queue"] = queued
    shapers = []
    for i, (p, adm) in enumerate(zip(prompts, adms)):
        echo = None
        if body.echo:
            truncated = params.truncate_prompt_tokens is not None and isinstance(p, str)
            echo = p if isinstance(p, str) and not truncated else \
                await ingress.engine.detokenize.remote(adm.prompt_token_ids)
        shapers.append(ChoiceShaper(i, params.n, echo, body.logprobs, body.prompt_only))
    finished = [False] * len(streams)
    if body.stream:
        state = fmt.StreamState(rid, created, model, False, body.return_token_ids,
                                body.return_tokens_as_token_ids, body.continuous_usage)
        ingress._live.hold(rid)
        return StreamingResponse(_sse(ingress, streams, finished, shapers, state, body.include_usage),
                                 media_type="text/event-stream", headers=headers)
    finals: list = [None] * len(streams)
    token_text: dict[int, str] = {}
    try:
        async with aclosing(_merged(streams, finished)) as merged:
            async for i, (out, tt) in merged:
                finals[i] = shapers[i].shape(out)
                token_text.update(tt or {})
    except asyncio.CancelledError:  # client went away: _merged cancelled the streams
        raise
    except Exception:  # a system error: logged with the request id, this request only
        logger.exception("request %s failed", rid)
        return error(500, f"internal error while generating request {rid}; see the server log")
    for out in finals:
        ingress._observe(out)
    resp = batch_response(rid, created, model, finals, shapers, token_text, body.return_token_ids,
                          params.prompt_logprobs, body.return_tokens_as_token_ids)
    return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)


async def _sse(ingress, streams, finished, shapers, state: fmt.StreamState, include_usage: bool):
    finals: list = [None] * len(streams)
    try:
        try:
            # aclosing: a client that leaves closes this generator at a yield; the merge
            # must then cancel the unfinished streams now, not when it is collected.
            async with aclosing(_merged(streams, finished)) as merged:
                async for i, (out, tt) in merged:
                    finals[i] = shaped = shapers[i].shape(out)
                    for line in state.chunks(shaped, tt or {}):
                        yield line
        except Exception:  # headers are gone: report in-band, as vLLM does
            logger.exception("request %s failed mid-stream", state.rid)
            for line in fmt.sse_failure(state.rid):
                yield line
            return
        if include_usage:
            yield state.usage_chunk(combined(state.rid, finals))
        yield fmt.SSE_DONE
        for out in finals:
            ingress._observe(out)
    finally:
        ingress._live.release(state.rid)
