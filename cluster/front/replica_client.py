"""The front's connection to its engine replicas: one client per ingress, which every
route that generates goes through.

    generate(request) ─▶ door: shed gate, front limit (door.py) ──────────▶ 429 here, no trip
                      ─▶ engine.generate over the Serve handle, with this front's output route
                      ◀─ its Admission (failover.admission): 400/429 before any header is sent
                      ◀─ the outputs, one message per engine step, on the output channel
                         (cluster/wire/output_channel.py), read as one stream (Accumulated)

It owns what the requests share: the output channel (made on the loop that reads it), the
lifeline of every replica it has heard from (cluster/wire/lifeline.py), and the loss future,
done when one of them ends and then renewed. A lost replica is routed around at once
(lost_replicas.py, routing.py); its requests that have shown the client none of their
output yet are tried again on another replica (failover.Resumable), and a stream that has
shown some ends with ReplicaLost, which the response turns into a 503. /health asks a
replica through this client too, so that a replica lost while it is asked is not the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import Response

from pagedserve.cluster.front.door import FrontLimit, LiveRequests, ShedGate
from pagedserve.cluster.front.edge import error
from pagedserve.cluster.front.failover import MAX_ATTEMPTS, Resumable, admission, patiently
from pagedserve.cluster.front.router.lost_replicas import mark_lost
from pagedserve.cluster.front.prompt_tokens import PromptTokens
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.tenants import DEFAULT_TENANT
from pagedserve.cluster.ray_utils import bind_host
from pagedserve.cluster.wire.failures import ReplicaLost
from pagedserve.cluster.wire.lifeline import LifelineWatch
from pagedserve.cluster.wire.output_channel import OutputChannel
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.cluster.wire.stream import Accumulated

logger = logging.getLogger("pagedserve")
HEALTH_TIMEOUT_S = 5.0  # /health: an engine that does not answer within this is unhealthy
# How often the front looks whether the Ray cluster has grown past one node (its output
# channel then listens on the node's address too: ray_utils.bind_host).
BIND_RECHECK_S = 10.0


class ReplicaClient:
    def __init__(self, engine, model: ServedModel, live: LiveRequests, tokenize_for_router: bool) -> None:
        self._engine = engine  # the replicas' Serve handle
        self._model = model
        self._live = live  # the ingress's requests in flight: the front limit counts them
        self._gate = ShedGate()  # replicas' recent 429s: refuse at the door while all shed
        self._limit = FrontLimit()  # requests in flight here, bound while they wait to reach a replica
        self._channel: OutputChannel | None = None  # made on the loop that reads it
        self._lifelines: dict[str, LifelineWatch | None] = {}  # replica id -> its watch; None: dead
        self._loss: asyncio.Future | None = None  # done when a replica is lost; then renewed
        self._bind_checked = 0.0  # when the channel's address was last chosen (BIND_RECHECK_S)
        # The KV router scores replicas on token ids: the prompt is tokenized here, once.
        self._tokens = PromptTokens(model.info) if tokenize_for_router else None

    async def generate(self, req: EngineRequest, *, whole: bool, arrival: float | None = None,
                       ids_shown: bool = True):
        """Open the engine stream of ``req``; return (stream, admission) or (None, error
        response). ``whole``: the response is sent when it ends (not streamed), so it may be
        tried again at any point; ``arrival``: when this front took the request (its TTFT
        starts there); ``ids_shown``: the response carries token ids. A request whose replica
        is lost before it has shown the client any output is tried on another (Resumable).
        With the KV router, a text prompt or chat is tokenized here first and goes on as
        token ids (``req.prompt``; ``req.messages`` None)."""
        if self._tokens is not None:
            try:
                ids = await self._tokens.encode(req)
            except ValueError as e:
                return None, error(400, str(e))
            if ids is not None:
                req.prompt, req.messages = ids, None
        rid = req.request_id

        async def again(retry: bool = False):
            for attempt in range(MAX_ATTEMPTS):
                try:
                    return await self._generate_once(req, arrival, retry or attempt > 0)
                except ReplicaLost as e:
                    if attempt + 1 == MAX_ATTEMPTS:
                        return None, error(503, f"{e}; no replica took the request {rid}", 1)
                    logger.warning("%s while request %s waited for admission; trying again", e, rid)
                    if self._model.metrics is not None:
                        self._model.metrics.requests_retried.inc()

        async def resume():
            if self._model.metrics is not None:
                self._model.metrics.requests_retried.inc()
            return await patiently(lambda: again(retry=True))  # the client holds a 200 already

        stream, adm = await again()
        if stream is None:
            return None, adm
        resumable = Resumable(stream, adm, resume, whole,
                              lambda a: self._live.placed(rid, a.replica_id), ids_shown)
        return resumable, adm

    async def _generate_once(self, req: EngineRequest, arrival: float | None, retry: bool = False):
        """One try. ``retry``: its replica was lost: the door let it in once already, and
        its wait so far is the loss's, not a queue's (the front limit does not see it)."""
        rid, tenant = req.request_id, req.tenant
        who = tenant or DEFAULT_TENANT
        now = time.monotonic()
        # (This request is in the live list already: the others are one fewer.)
        shed = None if retry else self._gate.refuse(now, who) or self._limit.refuse(
            now, len(self._live) - 1, lambda: self._live.tenant_share(tenant))
        if shed is not None:  # every replica is shedding (this tenant): no trip (door.py)
            if self._model.metrics is not None:
                self._model.metrics.shed_at_ingress.inc()
            return None, error(429, shed[0], shed[1])
        if self._channel is None:  # the outputs' way back: cluster/wire/output_channel.py
            self._channel = OutputChannel(bind_host())
            self._loss = asyncio.get_running_loop().create_future()
            self._bind_checked = now
        elif now - self._bind_checked > BIND_RECHECK_S:
            self._bind_checked = now
            asyncio.ensure_future(self._recheck_bind())  # a GCS call: never on this loop
        sub = self._channel.open(rid, arrival, self._model.first_output)
        stream = self._engine.options(stream=True).generate.remote(req, output_route=self._channel.route)
        try:
            adm = await admission(rid, stream, lambda: self._loss)
        except BaseException as e:
            sub.close()
            if isinstance(e, (asyncio.CancelledError, ReplicaLost)):
                stream.cancel()
            raise
        if arrival is not None and not retry:  # the wait before the replica: the front limit's signal
            now = time.monotonic()
            self._limit.observe(max(0.0, now - arrival - adm.replica_s), now)
        if not adm.accepted:
            sub.close()
            if adm.status == 429:
                self._gate.refused(adm.replica_id, adm.shed_s, time.monotonic(), adm.shed_tenant)
            return None, error(adm.status, adm.message, adm.retry_after_s)
        self._gate.accepted(adm.replica_id, time.monotonic(), who)
        self._watch(adm)
        if self._lifelines.get(adm.replica_id) is None and adm.lifeline is not None:
            sub.close()  # admitted by a replica this front has just seen die
            stream.cancel()
            raise ReplicaLost(adm.replica_id, "lost before its admission was read")
        return Accumulated(sub.attach(stream, adm.replica_id)), adm

    async def _recheck_bind(self) -> None:
        try:
            host = await asyncio.to_thread(bind_host)
        except Exception:  # the GCS is away: keep the address, look again later
            logger.debug("bind_host failed", exc_info=True)
            return
        self._channel.listen_on(host)

    def _watch(self, adm) -> None:
        """Watch the lifeline of a replica this front has not watched yet."""
        if adm.lifeline is None or adm.replica_id in self._lifelines:
            return
        self._lifelines[adm.replica_id] = LifelineWatch(adm.replica_id, adm.lifeline, self._replica_lost)

    def _replica_lost(self, replica_id: str, reason: str) -> None:
        """A replica's lifeline ended: route nothing more there, fail or retry what it held."""
        self._lifelines[replica_id] = None  # seen dead: never watched again
        mark_lost(replica_id)
        n = self._channel.fail_replica(replica_id, ReplicaLost(replica_id, reason))
        logger.warning("engine replica %s lost (%s): %d requests in flight there", replica_id, reason, n)
        if self._model.metrics is not None:
            self._model.metrics.replicas_lost.inc()
        loss, self._loss = self._loss, asyncio.get_running_loop().create_future()
        loss.set_result(replica_id)

    async def health(self) -> Response:
        """200, or the 503 that says why: asks an engine replica (loop alive, every TP worker
        answers), never cached info, as vLLM answers when its engine is dead, until Serve
        has replaced it. A replica lost while it is asked (its lifeline) is not the answer:
        a live one is."""
        for attempt in range(MAX_ATTEMPTS):
            loss = self._loss
            call = asyncio.ensure_future(self._ask_health())
            waits = {call} if loss is None else {call, loss}
            await asyncio.wait(waits, timeout=HEALTH_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                e = call.exception()
                if e is None:
                    return Response(status_code=200)
                if not (loss is not None and loss.done() and attempt + 1 < MAX_ATTEMPTS):
                    cause = getattr(e, "cause", None) or e
                    return error(503, f"The engine is unhealthy: {type(cause).__name__}: {cause}"[:500])
                continue
            call.cancel()
            if loss is None or not loss.done():
                return error(503, f"The engine did not answer within {HEALTH_TIMEOUT_S:.0f} s")
        return error(503, "engine replicas were lost while they were asked")

    async def _ask_health(self) -> None:
        await self._engine.health.remote()
