"""ZeroMQ plan broadcast: how the scheduler actor sends each step's plan to its TP workers.

    scheduler actor                       worker actor rank r (a thread of it)
      PUSH ──tcp── (one socket per rank) ──▶ PULL: plan bytes -> Worker.execute_model
      PULL ◀──────────────────────────────── PUSH: rank 0's ModelRunnerOutput (pickled)

One pickle per step, the same bytes written to every rank's socket; no Ray on the step
path at all. PUSH/PULL (not PUB/SUB) so nothing sent before a worker connects is lost.
Ranks other than 0 send nothing back unless they fail; the all-reduce inside the step
keeps them in lockstep with rank 0. Each plan goes out with a sequence number, and a
failure names the plan it is for: a step that failed on every rank (each rolled it back)
is a ``WorkerStepError`` the engine may contain; a failure on some ranks only, or one that
does not match the plan waited for, leaves the group out of step: ``ExecutorDeadError``. This is the shape of vLLM's message-queue broadcast,
with blocking reads instead of spinning (a spinning reader would steal a core from the
model on a 2-core box).
"""

from __future__ import annotations

import logging
import pickle
import shutil
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass

import zmq

from pagedserve.cluster.wire.failures import ExecutorDeadError

logger = logging.getLogger(__name__)

STOP = b"STOP"
_PROTOCOL = pickle.HIGHEST_PROTOCOL


# How long the other ranks have to report the same failure once one rank has (they may
# still be inside the step; one stuck in a collective with the failed rank never will).
AGREE_TIMEOUT_S = 10.0


class WorkerStepError(RuntimeError):
    """A step raised on every rank, and each rolled it back (worker/model_runner.py)."""


@dataclass(slots=True)
class WorkerFailure:
    rank: int
    seq: int  # the plan's sequence number
    error: str  # "TypeName: message", one line
    traceback: str  # for the log only, never for a client


def worker_loop(execute, rank: int, plan_addr: str, result_addr: str) -> int:
    """Runs inside a worker actor until STOP; returns the number of steps executed."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(plan_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(result_addr)
    steps = 0
    try:
        while True:
            msg = pull.recv(copy=False).buffer
            if msg == STOP:
                return steps
            seq, plan = pickle.loads(msg)
            try:
                out = execute(plan)
            except Exception as e:
                line = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                push.send(pickle.dumps(WorkerFailure(rank, seq, line, traceback.format_exc()), _PROTOCOL))
                continue
            steps += 1
            if rank == 0:
                push.send(pickle.dumps((seq, out), _PROTOCOL))
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


class ZmqBroadcast:
    """Driver side. ``addresses()`` gives each rank its (plan_addr, result_addr)."""

    def __init__(self, host: str, world_size: int, local: bool = False) -> None:
        """``local``: every rank runs on this node, so Unix sockets (ipc://) replace TCP."""
        self.world_size = world_size
        self._seq = 0
        self._waiting: deque[int] = deque()  # sequence numbers sent, not yet answered
        self._inbox: list = []  # messages read for a later plan than the one waited for
        self.ctx = zmq.Context()
        self.plan_socks = []
        self.plan_addrs = []
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-zmq-") if local else None
        self._all_ranks_read = False
        for rank in range(world_size + 1):
            s = self.ctx.socket(zmq.PUSH if rank < world_size else zmq.PULL)
            if local:
                addr = f"ipc://{self._ipc_dir}/{rank}"
                s.bind(addr)
            else:
                addr = f"tcp://{host}:{s.bind_to_random_port(f'tcp://{host}')}"
            if rank < world_size:
                self.plan_socks.append(s)
                self.plan_addrs.append(addr)
            else:
                self.result, self.result_addr = s, addr

    def addresses(self, rank: int) -> tuple[str, str]:
        return self.plan_addrs[rank], self.result_addr

    def send(self, plan, still_alive, poll_ms: int = 200) -> None:
        """To every rank. A PUSH socket whose peer died has no pipe left and blocks, so
        the send waits at most ``poll_ms`` at a time, checking ``still_alive()`` between."""
        # A plan that computes tokens runs the model, whose all-reduces need every rank.
        self._all_ranks_read = getattr(plan, "total_num_scheduled_tokens", 0) > 0
        self._seq += 1
        self._waiting.append(self._seq)
        data = pickle.dumps((self._seq, plan), _PROTOCOL)
        for s in self.plan_socks:
            while not s.poll(poll_ms, zmq.POLLOUT):
                still_alive()
            s.send(data, copy=False)

    def recv(self, still_alive, poll_ms: int = 200):
        """Rank 0's result for the oldest plan not yet answered. ``still_alive()`` is
        checked while waiting, so a dead worker raises instead of hanging the scheduler.
        If a rank failed the plan: WorkerStepError when every rank did (each rolled it
        back: the engine may re-run its parts), ExecutorDeadError when the ranks are out
        of step."""
        seq = self._waiting.popleft()
        failures: dict[int, WorkerFailure] = {}
        deadline = None
        while True:
            msg = self._take(seq) or self._next(still_alive, poll_ms, deadline)
            if msg is None:
                first = next(iter(failures.values()))
                missing = sorted(set(range(self.world_size)) - set(failures))
                raise ExecutorDeadError(f"rank {first.rank} failed a step and ranks {missing} did not "
                                        f"report it within {AGREE_TIMEOUT_S:g} s: {first.error}")
            msg_seq = msg.seq if isinstance(msg, WorkerFailure) else msg[0]
            if msg_seq > seq:  # another rank is ahead (rank 0 skipping the next plan)
                self._inbox.append(msg)
                continue
            if msg_seq < seq:
                raise ExecutorDeadError(f"tensor-parallel ranks are out of step: a rank failed plan "
                                        f"{msg_seq} after rank 0 had answered it: {msg.error}")
            if not isinstance(msg, WorkerFailure):
                if failures:
                    raise ExecutorDeadError(
                        "tensor-parallel ranks are out of step: rank 0 ran a step that ranks "
                        f"{sorted(failures)} failed: {next(iter(failures.values())).error}")
                break
            logger.error("worker rank %d failed plan %d: %s", msg.rank, seq, msg.traceback)
            failures[msg.rank] = msg
            if len(failures) == self.world_size:
                raise WorkerStepError(f"worker step failed on every rank: {msg.error}")
            deadline = deadline or time.monotonic() + AGREE_TIMEOUT_S
        out = msg[1]
        if self._ipc_dir is not None and self._all_ranks_read:
            # Every rank is connected once rank 0 answers a plan that ran the model (the
            # others took part in its all-reduces, so they read it): the socket files can
            # go now, which leaves nothing in /tmp even if this process is killed later.
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        return out

    def _take(self, seq: int):
        for i, msg in enumerate(self._inbox):
            if (msg.seq if isinstance(msg, WorkerFailure) else msg[0]) <= seq:
                del self._inbox[i]
                return msg
        return None

    def _next(self, still_alive, poll_ms: int, deadline: float | None = None):
        while not self.result.poll(poll_ms):
            still_alive()
            if deadline is not None and time.monotonic() > deadline:
                return None
        return pickle.loads(self.result.recv())

    def stop(self) -> None:
        for s in self.plan_socks:
            s.send(STOP)

    def close(self) -> None:
        for s in self.plan_socks:
            s.close(linger=100)
        self.result.close(linger=0)
        self.ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
