"""A replica's prefix-cache events on the wire, for the fronts' routers
(scheduler/kv/kv_events.py has the events themselves).

    engine replica, engine thread, every step       each front's router
      KVEventLog.take() ─▶ XPUB ──────tcp──────▶ SUB ─▶ KVView (per replica)
      a new subscription ─▶ a snapshot          ◀── (re)subscribe on join or on a gap

XPUB (verbose) hands the replica every subscription, so a subscriber that joins, or
that saw a gap in ``seq`` and subscribes again, gets a snapshot at the next step or
idle heartbeat; later batches apply on top of it. Every message's header carries the
replica's load and measured rates (ReplicaStats: what the router's cost model needs,
kv_routing.py); a step or heartbeat that changed no block sends a header alone (STATS),
at most every STATS_INTERVAL_S, so a quiet replica's figures do not go stale. A message
is plain packed numbers, never a pickle: a peer that reaches the port can at worst make
one router's view wrong, which costs cache hits and balance, not correctness.

    header  <BBqQQIIIIdddH WIRE_VERSION, kind (BATCH | CLEARED_BATCH | SNAPSHOT | STATS), seq,
                          waiting prefill tokens, running prefill tokens, waiting requests,
                          running requests, decoding requests, token budget per step,
                          prefill tokens/s, decode step seconds (0.0: not measured yet),
                          a LoRA adapter's read from disk in seconds (0.0: none read yet),
                          A: the LoRA adapters on its workers' host
    adapters  A x <q lora_int_id (scheduler/lora.adapter_id: the same on every process)
    body    BATCH: (<Bq kind, hash) per event; SNAPSHOT: <q per cached hash; STATS: none
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from pagedserve.scheduler.kv.kv_events import KVEventBatch, KVSnapshot, running_prefill, waiting_prefill

BATCH, CLEARED_BATCH, SNAPSHOT, STATS = 0, 1, 2, 3
TOPIC = b"kv"
WIRE_VERSION = 0xA3  # the first byte: a header of another layout (or none) is refused
STATS_INTERVAL_S = 0.1  # a header alone goes out at most this often
_HEAD = struct.Struct("<BBqQQIIIIdddH")
MAX_ADAPTERS = 0xFFFF
_EVENT = struct.Struct("<Bq")
_HASH = struct.Struct("<q")
_U32 = 0xFFFFFFFF


@dataclass(slots=True)
class ReplicaStats:
    """A replica's load and rates, as of the step its message follows."""

    waiting_prefill_tokens: int = 0  # net of the prefix cache (scheduler/kv/kv_events.waiting_prefill)
    running_prefill_tokens: int = 0  # running requests' prompt tokens not computed yet
    num_waiting_reqs: int = 0
    num_running_reqs: int = 0
    num_decoding_reqs: int = 0  # running requests past their prefill
    num_batched_tokens: int = 0  # its token budget per step (max_num_batched_tokens)
    prefill_tok_s: float = 0.0  # cluster/replica/step_rates.py; 0.0: not measured yet
    decode_step_s: float = 0.0
    lora_load_s: float = 0.0  # a LoRA adapter's read from disk (cluster/engine/lora_adapters.py); 0.0: none yet
    lora_adapters: tuple[int, ...] = ()  # the lora_int_ids on its workers' host


def replica_stats(sched, rates, loras=None) -> ReplicaStats:
    """``sched``'s queues now, with ``rates`` (a StepRates: prefill_tok_s, decode_step_s)
    and ``loras`` (the engine's LoRAAdapters: resident, load_s; None: LoRA off)."""
    tokens, decoding = running_prefill(sched)
    adapters = tuple(loras.resident[-MAX_ADAPTERS:]) if loras is not None else ()
    return ReplicaStats(waiting_prefill(sched), tokens, len(sched.waiting), len(sched.running), decoding,
                        sched.max_num_batched_tokens, rates.prefill_tok_s or 0.0, rates.decode_step_s or 0.0,
                        loras.load_s if loras is not None else 0.0, adapters)


def _head(kind: int, seq: int, s: ReplicaStats) -> bytes:
    def u32(n):
        return min(max(int(n), 0), _U32)

    adapters = s.lora_adapters[-MAX_ADAPTERS:]
    return _HEAD.pack(WIRE_VERSION, kind, seq, max(0, s.waiting_prefill_tokens), max(0, s.running_prefill_tokens),
                      u32(s.num_waiting_reqs), u32(s.num_running_reqs), u32(s.num_decoding_reqs),
                      u32(s.num_batched_tokens), float(s.prefill_tok_s), float(s.decode_step_s),
                      float(s.lora_load_s), len(adapters)) + b"".join(_HASH.pack(a) for a in adapters)


def encode_batch(batch: KVEventBatch, stats: ReplicaStats) -> bytes:
    kind = CLEARED_BATCH if batch.cleared else BATCH
    return _head(kind, batch.seq, stats) + b"".join(_EVENT.pack(k, h) for k, h in batch.events)


def encode_snapshot(snapshot: KVSnapshot, stats: ReplicaStats) -> bytes:
    return _head(SNAPSHOT, snapshot.seq, stats) + b"".join(_HASH.pack(h) for h in snapshot.block_hashes)


def encode_stats(seq: int, stats: ReplicaStats) -> bytes:
    return _head(STATS, seq, stats)


def decode(payload: bytes) -> tuple[KVEventBatch | KVSnapshot | None, ReplicaStats]:
    """(the batch or snapshot, None for a STATS message; the replica's stats). ValueError
    if malformed: short, another version, an unknown kind, a ragged body, a rate that is
    negative or not finite."""
    if len(payload) < _HEAD.size:
        raise ValueError("short KV event message")
    version, kind, seq, *counts, prefill_tok_s, decode_step_s, lora_load_s, num_adapters = _HEAD.unpack_from(payload)
    if version != WIRE_VERSION:
        raise ValueError(f"KV event message of another version ({version})")
    for rate in (prefill_tok_s, decode_step_s, lora_load_s):
        if not math.isfinite(rate) or rate < 0:
            raise ValueError("KV event message with a bad rate")
    end = _HEAD.size + num_adapters * _HASH.size
    if len(payload) < end:
        raise ValueError("short KV event message")
    adapters = tuple(a for (a,) in _HASH.iter_unpack(payload[_HEAD.size:end]))
    stats = ReplicaStats(*counts, prefill_tok_s, decode_step_s, lora_load_s, adapters)
    body = memoryview(payload)[end:]
    if kind == STATS:
        if len(body):
            raise ValueError("KV stats message with a body")
        return None, stats
    if kind == SNAPSHOT:
        if len(body) % _HASH.size:
            raise ValueError("ragged KV snapshot")
        return KVSnapshot(seq, [h for (h,) in _HASH.iter_unpack(body)]), stats
    if kind not in (BATCH, CLEARED_BATCH) or len(body) % _EVENT.size:
        raise ValueError("malformed KV event batch")
    return KVEventBatch(seq, kind == CLEARED_BATCH, list(_EVENT.iter_unpack(body))), stats


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
        self._last_sent = float("-inf")

    def pump(self, block_pool, stats: Callable[[], ReplicaStats]) -> None:
        """After a step (or on an idle heartbeat): publish the batch of
        ``block_pool.kv_events`` since the last pump, then a snapshot if anyone
        (re)subscribed since; when neither went, the stats alone, at most every
        STATS_INTERVAL_S. ``stats()`` is called only when something is sent."""
        log = block_pool.kv_events
        batch = log.take()
        sent = False
        if batch is not None:
            sent = self._send(encode_batch(batch, stats()))
        wanted = False
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            wanted |= msg[:1] == b"\x01"  # a subscription (b"\x00": one left)
        if wanted:
            sent |= self._send(encode_snapshot(log.snapshot(block_pool), stats()))
        if not sent and time.monotonic() - self._last_sent >= STATS_INTERVAL_S:
            self._send(encode_stats(log.seq, stats()))

    def _send(self, payload: bytes) -> bool:
        try:
            self._sock.send_multipart([TOPIC, payload], zmq.NOBLOCK)
        except zmq.Again:  # a slow subscriber's queue is full: it will see the gap
            return False
        self._last_sent = time.monotonic()
        return True

    def close(self) -> None:
        self._sock.close(0)


class KVEventSubscriber:
    """Router side: one replica's view and stats, brought up to date by :meth:`poll`
    (non-blocking: the router calls it before it scores a request, so it needs no task of
    its own). ``heard_at``: time.monotonic() when its last message was received (read by
    a poll), None before the first."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        from pagedserve.scheduler.kv.kv_events import KVView

        self.address = address
        self.view = KVView()
        self.stats = ReplicaStats()
        self.heard_at: float | None = None
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._awaiting_snapshot = True  # the subscription asked for one
        self._polled_at = float("-inf")

    def poll(self, min_interval_s: float = 0.0) -> None:
        """Reads what has come. With ``min_interval_s``, not again that soon after the last
        read (a router at a high decision rate over many replicas pays a socket call per
        replica per decision otherwise)."""
        now = time.monotonic()
        if now - self._polled_at < min_interval_s:
            return
        self._polled_at = now
        while True:
            try:
                _topic, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                msg, stats = decode(payload)
            except zmq.Again:
                return
            except ValueError:
                continue  # not the replica's (module doc): ignore it
            self.stats, self.heard_at = stats, time.monotonic()
            if msg is None:
                continue
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
