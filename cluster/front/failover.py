"""What the front does with a request whose engine replica is lost (cluster/wire/lifeline.py
says so; the replica client, replica_client.py, marks it lost and fails its streams with
ReplicaLost; a Ray error from the replica's own stream means the same):

    routed to it, no Admission yet     ─▶ admission() raises ReplicaLost ─▶ the client admits
                                         it again (another replica: routing.py skips the lost)
    admitted, no output shown yet      ─▶ Resumable admits it again and reads on
    a stream that showed output        ─▶ ReplicaLost reaches the response: an in-band 503

Output is shown (``shows_output``) once the client could see any of it: text, logprobs,
token ids where the response carries them, a finish. A sampled token whose text is held
back (part of a character, a special token) shows nothing, and neither does a chat's role
chunk, so such a stream still moves. A replica that refuses the retry for load (429, as the
one left may while it takes the lost one's share) or as unavailable (503) is asked again
after its Retry-After, for RESUME_PATIENCE_S at most: the client holds a 200 already.

A whole (not streamed) response has sent the client nothing until it ends, so it is
tried again at any point. At most MAX_ATTEMPTS tries in all.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.exceptions import RayActorError

from pagedserve.cluster.front.router.lost_replicas import is_lost, pop_routed, routed_to
from pagedserve.cluster.wire.failures import ReplicaLost

logger = logging.getLogger("pagedserve")

MAX_ATTEMPTS = 3  # tries of one request over lost replicas before it fails
RESUME_PATIENCE_S = 15.0  # how long a resumed stream waits out replicas that refuse it
RETRY_AFTER_CAP_S = 2.0  # a refusal's Retry-After, waited at most this long between asks


def shows_output(item, ids_shown: bool) -> bool:
    """Whether a stream item, (RequestOutput, token_text), gives the client any of the
    output: then the request can no longer move to another replica unseen."""
    out = item[0]
    if out.finished or out.prompt_logprobs is not None:
        return True
    return any(c.delta_text or c.delta_logprobs or c.finish_reason is not None or (ids_shown and c.delta_token_ids)
               for c in out.outputs)


def as_lost(e: Exception, replica_id: str | None) -> ReplicaLost | None:
    """``e`` as the loss of the request's replica (None: another failure). Ray raises
    RayActorError on a stream whose actor died or cannot be reached; the lifeline usually
    says so first, but not always."""
    if isinstance(e, ReplicaLost):
        return e
    if isinstance(e, RayActorError):
        return ReplicaLost(replica_id or "?", f"its stream failed ({type(e).__name__})")
    return None


class Resumable:
    """One engine request's outputs, carried over to another replica when its replica is
    lost before any of them was shown to the client (a stream), or at any point before the
    response (not streamed: the client has seen nothing). ``again()`` admits it anew:
    (stream, admission) or (None, error response). ``ids_shown``: the response carries
    token ids (so a token shows even when its text is held back)."""

    def __init__(self, stream, adm, again, restart_after_output: bool, on_placed, ids_shown: bool = True) -> None:
        self._stream, self._again = stream, again
        self._restart_after_output, self._on_placed = restart_after_output, on_placed
        self._ids_shown = ids_shown
        self._shown = False
        self._replica_id = adm.replica_id
        self.attempts = 1
        on_placed(adm)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                item = await self._stream.__anext__()
            except (ReplicaLost, RayActorError) as e:
                lost = as_lost(e, self._replica_id)
                if (self._shown and not self._restart_after_output) or self.attempts >= MAX_ATTEMPTS:
                    raise lost from (None if lost is e else e)
                self.attempts += 1
                logger.warning("%s; trying its request again on another replica (attempt %d)", lost, self.attempts)
                stream, adm = await self._again()
                if stream is None:
                    raise lost from None
                self._stream, self._replica_id = stream, adm.replica_id
                self._on_placed(adm)
                continue
            if not self._shown:
                self._shown = shows_output(item, self._ids_shown)
            return item

    def cancel(self) -> None:
        self._stream.cancel()


async def patiently(again, patience_s: float = RESUME_PATIENCE_S):
    """``again()`` until a replica admits the request, refuses it for a reason other than
    load or unavailability, or ``patience_s`` has passed: (stream, admission) or (None,
    the last error response)."""
    deadline = time.monotonic() + patience_s
    while True:
        stream, adm = await again()
        left = deadline - time.monotonic()
        if stream is not None or adm.status_code not in (429, 503) or left <= 0:
            return stream, adm
        try:
            wait = float(adm.headers.get("retry-after", 1))
        except ValueError:
            wait = 1.0
        await asyncio.sleep(min(wait, RETRY_AFTER_CAP_S, left))


async def admission(rid: str, stream, current_loss):
    """A generate stream's first item (its Admission), unless the replica it was routed to
    is lost meanwhile (ReplicaLost at once: try elsewhere). The router records where a
    request goes before it makes sure that replica is not lost (routing.py), so a request
    with no record when a replica is lost has not gone anywhere yet, and will not go to that
    one: it waits on. ``current_loss()``: the front's future that is done when the next
    replica is lost."""
    first = asyncio.ensure_future(stream.__anext__())
    try:
        while not first.done():
            loss = current_loss()
            await asyncio.wait((first, loss), return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                break
            where = routed_to(rid)
            if where is not None and is_lost(where):
                raise ReplicaLost(where, "while the request waited for its admission there")
        try:
            return first.result()
        except RayActorError as e:
            raise as_lost(e, routed_to(rid)) from e
    finally:
        pop_routed(rid)
        if not first.done():
            first.cancel()
