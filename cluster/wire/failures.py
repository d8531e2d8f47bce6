"""The failures that cross a process boundary, by whom they can be blamed on.

    ExecutorDeadError   executors -> engine loop    a worker is gone for good (its process
                                                    died, or a TP group is out of step)
    RequestFailed       replica -> front            this request failed on its own; the
                                                    others in its batch did not (a 500 that
                                                    names it)
    EngineDeadError     replica -> front            the replica's engine cannot step any
                                                    more (503; Serve replaces the replica)
    ReplicaLost         front's own                 the replica's process or node is gone
                                                    (its lifeline, lifeline.py): a request
                                                    that sent nothing yet is tried again
"""

from __future__ import annotations


class ExecutorDeadError(RuntimeError):
    """A worker is gone for good (its process died): no step can run any more."""


class RequestFailed(RuntimeError):
    """This request failed on its own; the others in its batch did not."""


class EngineDeadError(RuntimeError):
    """The replica's engine cannot step any more; Serve replaces the replica."""


class ReplicaLost(RuntimeError):
    """The replica serving a request is gone (its lifeline closed or fell silent)."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"engine replica {replica_id} was lost: {reason}")
        self.replica_id = replica_id
