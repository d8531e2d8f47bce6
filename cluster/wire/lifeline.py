"""A replica's lifeline: how the front learns within a second or two that an engine
replica is gone, long before Ray does.

    engine replica (Lifeline)                      front (LifelineWatch, one per replica)
      listener thread ◀──────────── tcp connect ──── on the replica's first Admission
      beat thread: b"." every BEAT_S ────────────▶  read: EOF or SILENCE_S of nothing
                                                       ─▶ on_lost(replica_id)

When a node dies, Ray's control plane marks its actors dead only after the GCS has missed
several of the raylet's health checks in a row, and until then a call to a replica there
waits (BENCHMARKS.md, the cluster table, has how long).
A TCP connection to the replica process says it at once: when the process dies the
kernel closes its sockets (the front reads EOF); when the machine itself goes away, the
beats stop and the front gives up after SILENCE_S.

The beats come from a thread of their own, so a long engine step or a busy event loop
does not silence them. The payload is nothing: a peer that is not the replica can learn
nothing here, and a wrong peer can at worst make one front think a replica is lost (it
then routes around it until Serve's own view catches up, see cluster/front/router/routing.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

logger = logging.getLogger("pagedserve")

BEAT_S = 0.25  # how often the replica says it is alive
SILENCE_S = 2.0  # nothing heard this long: the replica (or its machine) is gone


class Lifeline:
    """Replica side: listens on ``host`` and beats on every connection until closed."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="lifeline-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="lifeline-beat", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._peers.append(conn)

    def _beat(self) -> None:
        while not self._closed.wait(BEAT_S):
            with self._lock:
                peers = list(self._peers)
            for conn in peers:
                try:
                    conn.send(b".", socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass  # the front is behind reading; a full buffer is still a live peer
                except OSError:
                    with self._lock:
                        if conn in self._peers:
                            self._peers.remove(conn)
                    conn.close()

    def close(self) -> None:
        """The replica is leaving on purpose (graceful shutdown): the fronts see EOF."""
        self._closed.set()
        self._sock.close()
        with self._lock:
            peers, self._peers = self._peers, []
        for conn in peers:
            conn.close()


class LifelineWatch:
    """Front side: one connection to one replica's Lifeline. ``on_lost(replica_id,
    reason)`` runs once, on this event loop, when the replica stops answering."""

    def __init__(self, replica_id: str, address: str, on_lost) -> None:
        self.replica_id, self.address = replica_id, address
        self._on_lost = on_lost
        self.lost: str | None = None
        self.lost_at: float | None = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        host, port = self.address.rsplit(":", 1)
        reason = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), SILENCE_S)
        except (OSError, asyncio.TimeoutError) as e:
            reason = f"its lifeline {self.address} does not answer ({type(e).__name__})"
        else:
            try:
                while reason is None:
                    try:
                        data = await asyncio.wait_for(reader.read(4096), SILENCE_S)
                    except asyncio.TimeoutError:
                        # A loop that was itself blocked may see its timer before the
                        # beats that came meanwhile: look once more before giving up.
                        try:
                            data = await asyncio.wait_for(reader.read(4096), BEAT_S)
                        except asyncio.TimeoutError:
                            reason = f"nothing from it for {SILENCE_S:.0f} s"
                            break
                    except OSError as e:
                        reason = f"its lifeline broke ({type(e).__name__})"
                        break
                    if not data:
                        reason = "its process is gone (lifeline closed)"
            finally:
                writer.close()
        self.lost = reason
        self.lost_at = time.monotonic()
        self._on_lost(self.replica_id, reason)

    def close(self) -> None:
        self._task.cancel()
