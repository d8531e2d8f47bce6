"""A replica's prefix-cache events on the wire, for the fronts' routers
(scheduler/kv/kv_events.py has the events themselves).

    engine replica, engine thread, every step       each front's router
      KVEventLog.take() ─▶ XPUB ──────tcp──────▶ SUB ─▶ KVView (per replica)
      a new subscription ─▶ a snapshot          ◀── (re)subscribe on join or on a gap

XPUB (verbose) hands the replica every subscription, so a subscriber that joins, or
that saw a gap in ``seq`` and subscribes again, gets a snapshot at the next step or
idle heartbeat; later batches apply on top of it. A message is plain packed integers,
never a pickle: a peer that reaches the port can at worst make one router's view wrong,
which costs cache hits, not correctness.

    header  <BqQ   kind (BATCH | CLEARED_BATCH | SNAPSHOT), seq, waiting prefill tokens
    body    BATCH: (<Bq kind, hash) per event; SNAPSHOT: <q per cached hash
"""

from __future__ import annotations

import struct
from typing import Callable

import zmq

from pagedserve.scheduler.kv.kv_events import KVEventBatch, KVSnapshot

BATCH, CLEARED_BATCH, SNAPSHOT = 0, 1, 2
TOPIC = b"kv"
_HEAD = struct.Struct("<BqQ")
_EVENT = struct.Struct("<Bq")
_HASH = struct.Struct("<q")


def encode_batch(batch: KVEventBatch, waiting_tokens: int) -> bytes:
    kind = CLEARED_BATCH if batch.cleared else BATCH
    return _HEAD.pack(kind, batch.seq, waiting_tokens) + b"".join(_EVENT.pack(k, h) for k, h in batch.events)


def encode_snapshot(snapshot: KVSnapshot, waiting_tokens: int) -> bytes:
    return _HEAD.pack(SNAPSHOT, snapshot.seq, waiting_tokens) + b"".join(_HASH.pack(h) for h in snapshot.block_hashes)


def decode(payload: bytes) -> tuple[KVEventBatch | KVSnapshot, int]:
    """(the batch or snapshot, the replica's waiting prefill tokens); ValueError if malformed."""
    if len(payload) < _HEAD.size:
        raise ValueError("short KV event message")
    kind, seq, waiting = _HEAD.unpack_from(payload)
    body = memoryview(payload)[_HEAD.size:]
    if kind == SNAPSHOT:
        if len(body) % _HASH.size:
            raise ValueError("ragged KV snapshot")
        return KVSnapshot(seq, [h for (h,) in _HASH.iter_unpack(body)]), waiting
    if kind not in (BATCH, CLEARED_BATCH) or len(body) % _EVENT.size:
        raise ValueError("malformed KV event batch")
    return KVEventBatch(seq, kind == CLEARED_BATCH, list(_EVENT.iter_unpack(body))), waiting


class KVEventPublisher:
    """Replica side. Every call runs on the engine thread (the block pool's), so the
    socket has one user."""

    def __init__(self, host: str, context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every (re)subscription, not only the first
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    def pump(self, block_pool, waiting_tokens: Callable[[], int]) -> None:
        """After a step (or on an idle heartbeat): publish the batch of
        ``block_pool.kv_events`` since the last pump, then a snapshot if anyone
        (re)subscribed since. ``waiting_tokens()`` is called only when something is sent."""
        log = block_pool.kv_events
        batch = log.take()
        if batch is not None:
            self._send(encode_batch(batch, waiting_tokens()))
        wanted = False
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            wanted |= msg[:1] == b"\x01"  # a subscription (b"\x00": one left)
        if wanted:
            self._send(encode_snapshot(log.snapshot(block_pool), waiting_tokens()))

    def _send(self, payload: bytes) -> None:
        try:
            self._sock.send_multipart([TOPIC, payload], zmq.NOBLOCK)
        except zmq.Again:  # a slow subscriber's queue is full: it will see the gap
            pass

    def close(self) -> None:
        self._sock.close(0)


class KVEventSubscriber:
    """Router side: one replica's view, brought up to date by :meth:`poll` (non-blocking:
    the router calls it before it scores a request, so it needs no task of its own)."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        from pagedserve.scheduler.kv.kv_events import KVView

        self.address = address
        self.view = KVView()
        self.waiting_tokens = 0
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._awaiting_snapshot = True  # the subscription asked for one

    def poll(self) -> None:
        while True:
            try:
                _topic, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                msg, waiting = decode(payload)
            except zmq.Again:
                return
            except ValueError:
                continue  # not the replica's (module doc): ignore it
            self.waiting_tokens = waiting
            if isinstance(msg, KVSnapshot):
                self.view.reset(msg)
                self._awaiting_snapshot = False
            elif not self.view.apply(msg) and not self._awaiting_snapshot:
                self._resubscribe()

    def _resubscribe(self) -> None:
        """A gap: ask for a snapshot (the replica sees the subscription again)."""
        self._sock.setsockopt(zmq.UNSUBSCRIBE, TOPIC)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._awaiting_snapshot = True

    def close(self) -> None:
        self._sock.close(0)
