"""Ray Serve request router: a prompt goes to the replica that holds its prefix in its prefix
cache when that replica can admit it now, else to the replica with the most free KV memory and
least queued work.

Each engine replica reports `RoutingStats` through Serve's `record_routing_stats` hook (every
`request_routing_stats_period_s`). Between reports, the router's own count of requests it has
sent to a replica (Serve's queue-length cache) tells how many arrived since, and each is assumed
to take the replica's average KV share of a running request.

Why KV rather than request counts: a sparse engine keeps a different number of prompt tokens per
request (prompt length, budget, pool), so two replicas with the same number of requests can have
very different room left; a request admitted where KV is short waits (or preempts another), while
an emptier replica would have started it at once.

Prefix affinity: each replica's prefix cache holds the prompts it served lately, so a prompt that
starts like one of them (a shared document or system prompt, a conversation's next turn) is
prefilled from its first new token there and from scratch anywhere else. The router remembers
which replica it sent each prompt prefix to (`PrefixOwners`: a hash chain over the prompt in
fixed chunks, least recently used forgotten first) and sends a prompt to the replica of its
longest remembered prefix when that replica can admit it now; otherwise the KV ranking decides,
and the prompt's prefix then belongs to the replica it went to: the one Serve sent it to
(`on_request_routed`), which need not be the first of the ranking: Serve goes on to the next
rank when the first does not take the request (its queue-length probe unanswered in time).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from service.messages import GenerateRequest, RoutingStats

# A prefix is remembered in chunks of this many prompt tokens (token-id prompts) or characters
# (text prompts and chat messages, about 4 characters a token): a prompt that shares less than
# one chunk with another is not routed for it.
PREFIX_CHUNK_TOKENS = 64
PREFIX_CHUNK_CHARS = 256
# Prefix chunks remembered (one dict entry each): 200,000 is 50 million tokens of prompts, far
# more than the replicas' caches hold.
PREFIX_OWNERS_MAX = 200_000
# Requests that may wait on the replica owning a prompt's prefix, which still gets the prompt
# when its KV cache has room: waiting behind one or two admissions costs less than prefilling
# the cached part again elsewhere (a loaded replica that spaces its admissions has one waiting
# most of the time).
AFFINITY_MAX_QUEUED = 2


def rank_key(
    stats: RoutingStats | None, ongoing: int | None, sent: int = 0
) -> tuple[int, float, float]:
    """Sort key, best first. Replicas that can admit one more request now come first, the one
    with the most projected free KV first; the others follow, least queued work first, then the
    most KV left once the queued requests and one more are admitted (negated: not above 0, it
    has room for them). `ongoing`: Serve's count of the replica's requests; `sent`: the ones
    this router sent it since its report (`SentSinceReport`), whichever says more arrived."""
    if stats is None:  # not reported yet (just started): empty but for what was sent
        return (0, -1.0, float(max(ongoing or 0, sent)))
    reported = stats.num_running + stats.num_waiting
    arrived = max((ongoing if ongoing is not None else reported) - reported, sent, 0)
    free = stats.kv_free_fraction - arrived * stats.kv_per_request_fraction
    seats = stats.max_num_seqs - stats.num_running - arrived
    queued = stats.num_waiting + max(-seats, 0)
    if queued == 0 and seats > 0 and free >= stats.kv_per_request_fraction:
        return (0, -free, float(reported + arrived))
    return (1, float(queued), (queued + 1) * stats.kv_per_request_fraction - free)


def _stats(replica: RunningReplica) -> RoutingStats | None:
    try:
        return RoutingStats(**replica.routing_stats) if replica.routing_stats else None
    except TypeError:  # a replica of another version reporting other fields
        return None


def prefix_keys(request: GenerateRequest) -> list[int]:
    """The hash chain of the request's prompt, one key per full chunk: key i stands for the
    prompt's first i + 1 chunks."""
    if request.messages is not None:
        units: Any = "".join(f"\x1e{m.get('role')}\x1f{m.get('content')}" for m in request.messages)
        size = PREFIX_CHUNK_CHARS
    elif isinstance(request.prompt, str):
        units, size = request.prompt, PREFIX_CHUNK_CHARS
    else:
        units, size = request.prompt or [], PREFIX_CHUNK_TOKENS
    keys, key = [], hash(type(units).__name__)
    for start in range(0, len(units) - size + 1, size):
        chunk = units[start : start + size]
        key = hash((key, chunk if isinstance(chunk, str) else tuple(chunk)))
        keys.append(key)
    return keys


class SentSinceReport:
    """Requests this router sent each replica since the routing report of it that the router
    last saw. Serve's queue-length count lags a burst: prompts routed at once all see the same
    count, and would all go to the replica that ranked first (a burst of 6 chats' first turns
    over 2 idle replicas went 4 and 2, and the 4th owner's next turns found its queue too long
    to wait in); counted here, each choice ranks the next."""

    def __init__(self) -> None:
        self._report: dict[Any, dict | None] = {}
        self._sent: dict[Any, int] = {}

    def count(self, replica: Any, report: dict | None) -> int:
        """Requests sent to `replica` since `report` (its routing stats as Serve holds them),
        which starts the count again when it differs from the one seen before."""
        if replica not in self._report or self._report[replica] != report:
            self._report[replica] = None if report is None else dict(report)
            self._sent[replica] = 0
        return self._sent[replica]

    def add(self, replica: Any) -> None:
        self._sent[replica] += 1

    def keep(self, replicas: set[Any]) -> None:
        """Forget the replicas not among these (stopped)."""
        for gone in set(self._report) - replicas:
            del self._report[gone], self._sent[gone]


class PrefixOwners:
    """Which replica each remembered prompt prefix was sent to, least recently used first."""

    def __init__(self, capacity: int = PREFIX_OWNERS_MAX) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, Any] = OrderedDict()

    def longest(self, keys: list[int], replicas: set[Any]) -> Any | None:
        """The replica of the longest prefix among `keys` owned by one of `replicas`."""
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner in replicas:
                return owner
        return None

    def assign(self, keys: list[int], replica: Any) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


def keeps_its_prefixes(rank: tuple[int, float, float]) -> bool:
    """Whether a replica of this `rank_key` gets the prompts whose prefix it holds: it can admit
    one now, or at most AFFINITY_MAX_QUEUED wait there and its KV cache has room for them and
    one more."""
    must_wait, queued, minus_room = rank
    return must_wait == 0 or (queued <= AFFINITY_MAX_QUEUED and minus_room <= 0)


def route(ranks: dict[Any, tuple], prefix: list[int], owners: PrefixOwners) -> list[Any]:
    """Replica ids best first, from their `rank_key`s: the KV ranking, except that the replica
    owning the prompt's longest remembered prefix comes first when it keeps its prefixes. The
    prefix then belongs to the first."""
    ranked = sorted(ranks, key=ranks.__getitem__)
    owner = owners.longest(prefix, set(ranks))
    if owner is not None and keeps_its_prefixes(ranks[owner]):
        ranked.sort(key=lambda r: r != owner)
    owners.assign(prefix, ranked[0])
    return ranked


class KVCapacityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.prefix_owners = PrefixOwners()
        self.sent = SentSinceReport()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate in its own rank, best first: Serve tries them in this order and takes
        the first whose queue is not full (`max_ongoing_requests`)."""
        cache = self.replica_queue_len_cache
        replicas = {r.replica_id: r for r in candidate_replicas}
        self.sent.keep(set(replicas))
        ranks = {
            i: rank_key(_stats(r), cache.get(i), self.sent.count(i, r.routing_stats))
            for i, r in replicas.items()
        }
        ranked = route(ranks, _prefix(pending_request), self.prefix_owners)
        self.sent.add(ranked[0])  # Serve sends it there unless that replica's queue is full
        return [[replicas[i]] for i in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        """The prompt's prefix belongs to the replica Serve sent it to, which need not be the
        first of the ranking (module docstring)."""
        self.prefix_owners.assign(_prefix(pending_request), replica_id)


def _prefix(pending_request: PendingRequest | None) -> list[int]:
    """The prompt's prefix keys, if the request is an engine's GenerateRequest."""
    request = pending_request.args[0] if pending_request and pending_request.args else None
    return prefix_keys(request) if isinstance(request, GenerateRequest) else []
