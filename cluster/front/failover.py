"""What the front does with a request whose engine replica is lost (cluster/wire/lifeline.py
says so; the replica client, replica_client.py, marks it lost and fails its streams with
ReplicaLost):

    waiting for its Admission there ─▶ admission() raises ReplicaLost ─▶ the client admits
                                       it again (another replica: routing.py skips the lost)
    admitted, nothing sent yet       ─▶ Resumable admits it again and reads on
    a stream that sent tokens        ─▶ ReplicaLost reaches the response: an in-band 503

A whole (not streamed) response has sent the client nothing until it ends, so it is
tried again at any point. At most MAX_ATTEMPTS tries in all.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.cluster.front.router.lost_replicas import pop_routed, routed_to
from pagedserve.cluster.wire.failures import ReplicaLost

logger = logging.getLogger("pagedserve")

# A request still waiting for its Admission when some replica is lost, and whose replica
# the router did not record (routing.py), may be waiting on that one: it is tried again if
# its Admission has not come this long after the loss.
ADMIT_AFTER_LOSS_S = 1.5
MAX_ATTEMPTS = 3  # tries of one request over lost replicas before it fails


class Resumable:
    """One engine request's outputs, carried over to another replica when its replica is
    lost before any of them reached the client (a stream), or at any point before the
    response (not streamed: the client has seen nothing). ``again()`` admits it anew:
    (stream, admission) or (None, error response)."""

    def __init__(self, stream, adm, again, restart_after_output: bool, on_placed) -> None:
        self._stream, self._again = stream, again
        self._restart_after_output, self._on_placed = restart_after_output, on_placed
        self._sent = False
        self.attempts = 1
        on_placed(adm)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                item = await self._stream.__anext__()
            except ReplicaLost as e:
                if (self._sent and not self._restart_after_output) or self.attempts >= MAX_ATTEMPTS:
                    raise
                self.attempts += 1
                logger.warning("%s; trying its request again on another replica (attempt %d)", e, self.attempts)
                stream, adm = await self._again()
                if stream is None:
                    raise e
                self._stream = stream
                self._on_placed(adm)
                continue
            self._sent = True
            return item

    def cancel(self) -> None:
        self._stream.cancel()


async def admission(rid: str, stream, current_loss):
    """A generate stream's first item (its Admission), unless the replica it was routed to
    is lost meanwhile (ReplicaLost at once: try elsewhere). Where the router did not say
    where it went, a loss gives it ADMIT_AFTER_LOSS_S more before it is tried elsewhere.
    ``current_loss()``: the front's future that is done when the next replica is lost."""
    first = asyncio.ensure_future(stream.__anext__())
    try:
        while not first.done():
            loss = current_loss()
            await asyncio.wait((first, loss), return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                break
            where = routed_to(rid)
            if where == loss.result():
                raise ReplicaLost(where, "while the request waited for its admission there")
            if where is None:
                done, _ = await asyncio.wait((first,), timeout=ADMIT_AFTER_LOSS_S)
                if not done:  # it may have been routed there
                    raise ReplicaLost(loss.result(), "while a request waited for its admission")
        return first.result()
    finally:
        pop_routed(rid)
        if not first.done():
            first.cancel()
