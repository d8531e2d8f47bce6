"""What crosses a process boundary between the front, the replica, the engine loop and
the executors, in one place that each side imports (and no side imports the other):

    request.py          EngineRequest: the one request object, front to engine
    outputs.py          RequestOutput / CompletionOutput: what a request produced so far
    stream.py           a generate() stream's items: Admission, QueueStatus, then outputs
                        (merged when a reader falls behind)
    output_channel.py   the ZMQ channel that carries every step's outputs to an ingress
    lifeline.py         a replica's liveness as its fronts see it (a TCP line that beats)
    stats.py            the stats snapshot a replica pushes to the /metrics aggregator
    failures.py         ExecutorDeadError, RequestFailed, EngineDeadError, ReplicaLost

Imports: nothing of cluster/ but itself; scheduler/ types at most.
"""
