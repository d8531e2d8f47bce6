"""The engine replicas this process has seen die, and the routers that must skip them.

    lifeline EOF / silence (cluster/wire/lifeline.py) ─▶ mark_lost(replica_id)
        ─▶ every registered router (routing.py) drops it on its own event loop

A separate module from the router on purpose: Serve pickles a custom router's module by
value into the process that routes (ray/serve/config.py), so state kept there would be a
copy the front never sees. This module is imported by reference on both sides: one
registry per process.

A lost mark expires after LOST_TTL_S: by then Serve has replaced the replica (a new one
has a new id), and a mark set by mistake does not keep a live replica out for good.
"""

from __future__ import annotations

import threading
import time
import weakref

LOST_TTL_S = 120.0

_lock = threading.Lock()
_lost: dict[str, float] = {}  # replica unique id -> when this process saw it die
_routers: weakref.WeakSet = weakref.WeakSet()
# request id -> the replica its generate call was routed to, until its admission is read:
# a request waiting for its admission on a replica that dies is tried again at once.
_routed: dict[str, str] = {}
MAX_ROUTED = 100_000  # bounds what a caller that never pops could leave here


def routed(request_id: str, replica_id: str) -> None:
    """The router sent ``request_id`` to ``replica_id``. Any thread."""
    with _lock:
        if len(_routed) >= MAX_ROUTED:
            _routed.clear()
        _routed[request_id] = replica_id


def pop_routed(request_id: str) -> str | None:
    """Where ``request_id`` was routed (None: not yet, or unknown), forgetting it."""
    with _lock:
        return _routed.pop(request_id, None)


def routed_to(request_id: str) -> str | None:
    with _lock:
        return _routed.get(request_id)


def is_lost(replica_id: str, now: float | None = None) -> bool:
    with _lock:
        t = _lost.get(replica_id)
    return t is not None and (now if now is not None else time.monotonic()) - t < LOST_TTL_S


def register(router) -> None:
    """A router of this process; ``router.drop_lost()`` runs on its loop after each loss."""
    with _lock:
        _routers.add(router)


def mark_lost(replica_id: str) -> None:
    """This process saw ``replica_id`` die: route nothing more to it. Any thread."""
    now = time.monotonic()
    with _lock:
        _lost[replica_id] = now
        for rid, t in list(_lost.items()):
            if now - t >= LOST_TTL_S:
                del _lost[rid]
        routers = list(_routers)
    for router in routers:
        loop = router._lazily_fetched_loop  # Serve's router loop, once it has routed
        if loop is None:
            router.drop_lost()
        else:
            loop.call_soon_threadsafe(router.drop_lost)
