"""How the front picks an engine replica: Serve's power-of-two-choices router, minus the
replicas this front has seen die (lost_replicas.py).

    Serve's controller: the replica list ─▶ LiveReplicaRouter.update_replicas ─▶ minus lost
    lost_replicas.mark_lost(id)          ─▶ LiveReplicaRouter.drop_lost (at once)

Serve's router learns that a replica is gone from the controller, which learns it from
the GCS, which on a lost node waits for several missed raylet health checks in a row.
Until then new requests would be routed to the dead replica and wait there.

The router runs in the process that holds the engine handle (the ingress replica), on
Serve's router event loop. Serve pickles this module by value into that process, so it
keeps no state of its own.
"""

from __future__ import annotations

import time

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from pagedserve.cluster.front import lost_replicas

ROUTER_PATH = "pagedserve.cluster.front.routing.LiveReplicaRouter"


class LiveReplicaRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's default router over the replicas not marked lost."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        lost_replicas.register(self)

    def update_replicas(self, replicas) -> None:
        now = time.monotonic()
        super().update_replicas([r for r in replicas if not lost_replicas.is_lost(r.replica_id.unique_id, now)])

    async def _choose_replica_for_request(self, pending_request, *, is_retry: bool = False):
        # Serve's hook that resolves a request to its replica: remember where each engine
        # request went, so the front knows which admissions a lost replica took with it.
        replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        if pending_request.metadata.call_method == "generate" and pending_request.args:
            lost_replicas.routed(str(pending_request.args[0]), replica.replica_id.unique_id)
        return replica

    def drop_lost(self) -> None:
        now = time.monotonic()
        for replica_id in list(self.curr_replicas):
            if lost_replicas.is_lost(replica_id.unique_id, now):
                self.on_replica_actor_died(replica_id)
