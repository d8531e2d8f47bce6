"""The engine -> ingress output channel: one message per engine step for all of one
ingress replica's requests, instead of one Ray stream item per request per step.

    engine replica, after each step                 ingress replica
      outputs ─ grouped by route ─▶ PUSH ──tcp──▶ PULL ─ reader task ─▶ ChannelStream(rid)
              (one message per ingress per step)          (merges the steps its reader missed)

Ray stream items cost serving-path CPU per token in the engine replica, Ray and the
ingress (loadtest/serving/bench_frontend.py measures it; BENCHMARKS.md). vLLM's engine core, too,
sends its API server one message per step.

``generate()``'s Ray stream stays the request's lifeline. Its first item is the
Admission. It ends once the final output has been sent on the channel, and it raises the
request's failure (RequestFailed, a dead replica, a dead actor). Cancelling it aborts the
request. Only the outputs take the channel.

A message is ``[HMAC-SHA256(key, payload), payload]``; the payload is the pickle of
``[(request_id, (slim RequestOutput, token_text)), ...]``. The key is the ingress's own
and reaches the engine inside the generate call (over Ray). The reader drops a message
whose MAC is wrong before unpickling it, so reaching the port is not enough to make the
ingress unpickle anything.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import pickle
import secrets
import time

import zmq
import zmq.asyncio

from pagedserve.cluster.wire.stream import merge_items, slim

logger = logging.getLogger("pagedserve")

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Messages (steps) an engine queues for one ingress before it fails that ingress's
# requests rather than hold their outputs in memory: ~1000 steps behind.
SEND_HWM = 1000
# The Ray stream may end a moment before the final output's message is read (two
# channels); a final output that has not come this long after is declared lost.
FINAL_GRACE_S = 30.0
_RAY_END = object()
# What a routed request's queue gets on the engine (besides QueueStatus and failures): its
# first output went out on the channel (so the Admission may go), its final one did.
SENT, DONE = object(), object()


def _mac(key: bytes, payload: bytes) -> bytes:
    return hmac.digest(key, payload, "sha256")


class Route:
    """Where one request's outputs go (engine side): the ingress's address and key, and
    whether its first output (the one that carries the prompt ids) is still to go."""

    __slots__ = ("addr", "key", "first")

    def __init__(self, addr: str, key: bytes) -> None:
        self.addr, self.key, self.first = addr, key, True


class ChannelSender:
    """Engine replica side: one PUSH socket per ingress address. ``send`` never blocks:
    False when that ingress is SEND_HWM messages behind (or gone)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context | None = None
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, addr: str, key: bytes, items: list) -> bool:
        sock = self._socks.get(addr)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self._socks[addr] = sock
        payload = pickle.dumps(items, _PROTOCOL)
        try:
            sock.send_multipart([_mac(key, payload), payload], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class OutputRouter:
    """Engine replica side: the routed requests, and one message per ingress per step."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._sender = ChannelSender()

    def add(self, request_id: str, route: tuple[str, bytes]) -> None:
        self._routes[request_id] = Route(*route)

    def remove(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def send(self, outputs, queues: dict) -> list[str]:
        """Send a step's (RequestOutput, token_text) of routed requests; mark SENT / DONE
        in their queues once sent (the Ray stream ends behind the final output). Returns
        the ids whose ingress is SEND_HWM messages behind: nothing of theirs was sent."""
        batches: dict[str, tuple[bytes, list, list]] = {}
        for out, token_text in outputs:
            route = self._routes[out.request_id]
            _, items, marks = batches.setdefault(route.addr, (route.key, [], []))
            items.append((out.request_id, (slim(out, route.first), token_text)))
            if route.first or out.finished:
                marks.append((queues[out.request_id], DONE if out.finished else SENT))
            route.first = False
        lost = []
        for addr, (key, items, marks) in batches.items():
            if self._sender.send(addr, key, items):
                for q, mark in marks:
                    q.put_nowait(mark)
            else:
                logger.error("output channel to %s is %d steps behind: failing its %d requests",
                             addr, SEND_HWM, len(items))
                lost += [rid for rid, _ in items]
        return lost

    def close(self) -> None:
        self._sender.close()


class OutputChannel:
    """Ingress replica side: a PULL socket on ``host`` (this node's address) and the
    streams it feeds. Create it on the event loop that reads it. ``route``: what the
    engine is given in ``generate(..., output_route=route)``."""

    def __init__(self, host: str) -> None:
        self._key = secrets.token_bytes(32)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # the engines' SEND_HWM bounds what may queue
        self._sock.setsockopt(zmq.LINGER, 0)
        self.host = host
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.route = (f"tcp://{host}:{port}", self._key)
        self._streams: dict[str, ChannelStream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.rejected = 0  # messages whose MAC was wrong

    def listen_on(self, host: str) -> None:
        """Also listen on ``host`` and give engines that address from now on (the cluster
        grew past one node: a replica elsewhere cannot reach loopback). Requests already
        routed keep the address they were given; the old one stays bound."""
        if host != self.host:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.host, self.route = host, (f"tcp://{host}:{port}", self._key)

    def open(self, request_id: str, arrival: float | None = None, on_first=None) -> "ChannelStream":
        """Before the generate call, so no output can come before its stream exists.
        ``arrival``: when the front took the request (time.monotonic); ``on_first(ttft_s)``
        runs when its first output comes."""
        stream = self._streams[request_id] = ChannelStream(self, request_id, arrival, on_first)
        return stream

    def fail_replica(self, replica_id: str, error: Exception) -> int:
        """``replica_id`` is gone: its streams raise ``error`` after what they got; their
        Ray streams are cancelled (they would wait for Ray to notice). Returns how many."""
        streams = [s for s in self._streams.values() if s.replica_id == replica_id]
        for stream in streams:
            stream._push(error)
            if stream._ray is not None:
                stream._ray.cancel()
        return len(streams)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held until done: a stream may be dropped before its watcher ends
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2 or not hmac.compare_digest(frames[0], _mac(self._key, frames[1])):
                self.rejected += 1
                logger.warning("output channel: dropped a message that is not from an engine "
                               "replica (%d so far)", self.rejected)
                continue
            try:
                items = pickle.loads(frames[1])
            except Exception:  # an engine of another version: log, and go on reading
                logger.exception("output channel: a message could not be read")
                continue
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:  # else: cancelled here, its outputs still on the way
                    stream._push(item)

    def close(self) -> None:
        self._reader.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._sock.close(linger=0)
        self._ctx.term()


class ChannelStream:
    """One request's outputs from the channel, read as its Ray stream was:
    ``async for (RequestOutput, token_text)``, where the outputs its reader did not keep up
    with come merged into one; ``cancel()`` cancels the Ray stream (the engine aborts)."""

    def __init__(self, channel: OutputChannel, request_id: str, arrival: float | None = None,
                 on_first=None) -> None:
        self._channel, self.request_id = channel, request_id
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._ray = None
        self.replica_id: str | None = None  # the replica that admitted it (attach)
        self._done = False
        # Called once, at the first output, when the front gave its arrival time.
        self._arrival, self._on_first = arrival, (on_first if arrival is not None else None)

    def attach(self, ray_stream, replica_id: str | None = None) -> "ChannelStream":
        """Once the Admission is read: watch the rest of the Ray stream for its end."""
        self._ray, self.replica_id = ray_stream, replica_id
        self._channel._spawn(self._watch())
        return self

    async def _watch(self) -> None:
        try:
            async for _ in self._ray:  # nothing comes after the Admission
                pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the request's failure, raised to its reader in order
            self._push(e)
            return
        self._push(_RAY_END)

    def _push(self, item) -> None:
        if self._on_first is not None and isinstance(item, tuple):
            on_first, self._on_first = self._on_first, None
            on_first(time.monotonic() - self._arrival)
        self._items.append(item)
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        ended = False
        while not self._done:
            merged = None
            while self._items:
                item = self._items[0]
                if isinstance(item, Exception) and merged is not None:
                    break  # what came before it first
                self._items.popleft()
                if item is _RAY_END:
                    ended = True  # the final output is still on its way
                elif isinstance(item, Exception):
                    self.close()
                    raise item
                else:
                    merged = item if merged is None else merge_items(merged, item)
                    if item[0].finished:
                        self.close()
                        break
            if merged is not None:
                return merged
            self._ready.clear()
            if not ended:
                await self._ready.wait()
                continue
            try:
                await asyncio.wait_for(self._ready.wait(), FINAL_GRACE_S)
            except asyncio.TimeoutError:
                self.close()
                raise RuntimeError(f"request {self.request_id}: the engine ended its stream, "
                                   f"but its final output never came") from None
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop reading (finished, failed, or given up): its later messages are dropped."""
        self._done = True
        self._channel._forget(self.request_id)

    def cancel(self) -> None:
        self.close()
        if self._ray is not None:
            self._ray.cancel()
