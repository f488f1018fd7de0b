"""Ray Serve request router: prefer the replica with the most free KV memory and least queued work.

Each engine replica reports `RoutingStats` through Serve's `record_routing_stats` hook (every
`request_routing_stats_period_s`). Between reports, the router's own count of requests it has
sent to a replica (Serve's queue-length cache) tells how many arrived since, and each is assumed
to take the replica's average KV share of a running request.

Why KV rather than request counts: a sparse engine keeps a different number of prompt tokens per
request (prompt length, budget, pool), so two replicas with the same number of requests can have
very different room left; a request admitted where KV is short waits (or preempts another), while
an emptier replica would have started it at once.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from service.messages import RoutingStats


def rank_key(stats: RoutingStats | None, ongoing: int | None) -> tuple[int, float, float]:
    """Sort key, best first. Replicas that can admit one more request now come first, the one
    with the most projected free KV first; the others follow, least queued work first."""
    if stats is None:  # not reported yet (just started): assume empty
        return (0, -1.0, float(ongoing or 0))
    reported = stats.num_running + stats.num_waiting
    arrived = max((ongoing if ongoing is not None else reported) - reported, 0)
    free = stats.kv_free_fraction - arrived * stats.kv_per_request_fraction
    seats = stats.max_num_seqs - stats.num_running - arrived
    queued = stats.num_waiting + max(-seats, 0)
    if queued == 0 and seats > 0 and free >= stats.kv_per_request_fraction:
        return (0, -free, float(reported + arrived))
    return (1, float(queued), -free)


def _stats(replica: RunningReplica) -> RoutingStats | None:
    try:
        return RoutingStats(**replica.routing_stats) if replica.routing_stats else None
    except TypeError:  # a replica of another version reporting other fields
        return None


class KVCapacityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate in its own rank, best first: Serve tries them in this order and takes
        the first whose queue is not full (`max_ongoing_requests`)."""
        cache = self.replica_queue_len_cache
        ranked = sorted(
            candidate_replicas, key=lambda r: rank_key(_stats(r), cache.get(r.replica_id))
        )
        return [[replica] for replica in ranked]
