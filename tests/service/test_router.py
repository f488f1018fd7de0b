"""The Ray request router's KV-capacity ranking and prefix affinity, and what a replica
reserves."""

from __future__ import annotations

from service.messages import GenerateRequest, RoutingStats
from service.ray_app import replica_resources
from service.router import (
    PREFIX_CHUNK_CHARS,
    PREFIX_CHUNK_TOKENS,
    PrefixOwners,
    SentSinceReport,
    prefix_keys,
    rank_key,
    route,
)


def stats(free: float, per_request: float = 0.05, running: int = 0, waiting: int = 0,
          max_num_seqs: int = 64) -> RoutingStats:  # fmt: skip
    return RoutingStats(free, per_request, running, waiting, max_num_seqs)


def best(*candidates: tuple[RoutingStats | None, int | None]) -> int:
    keys = [rank_key(s, ongoing) for s, ongoing in candidates]
    return keys.index(min(keys))


def test_more_free_kv_wins_over_fewer_requests():
    # Replica 0 runs 2 long prompts that fill half its KV; replica 1 runs 6 short ones (30%).
    assert best((stats(0.5, 0.25, running=2), 2), (stats(0.7, 0.05, running=6), 6)) == 1


def test_requests_sent_since_the_last_report_use_up_projected_kv():
    # Same report, but 10 requests went to replica 0 since: at 0.05 each its KV is projected full.
    report = stats(0.6, 0.05, running=2)
    assert best((report, 12), (stats(0.5, 0.05, running=2), 2)) == 1
    assert best((report, 2), (stats(0.5, 0.05, running=2), 2)) == 0


def test_a_replica_that_cannot_admit_ranks_after_one_that_can():
    full = stats(0.01, 0.1, running=9)  # less free KV than one request takes
    assert best((full, 9), (stats(0.3, 0.1, running=7), 7)) == 1
    no_seat = stats(0.9, 0.01, running=64)  # free KV but every batch slot taken
    assert best((no_seat, 64), (stats(0.2, 0.1, running=8), 8)) == 1


def test_among_replicas_that_cannot_admit_the_least_queued_wins():
    assert best((stats(0.0, 0.1, running=10, waiting=5), 15),
                (stats(0.0, 0.1, running=10, waiting=2), 12)) == 1  # fmt: skip


def test_a_replica_without_a_report_counts_as_empty():
    assert best((None, 0), (stats(0.5, running=3), 3)) == 0
    assert best((None, 0), (None, 1)) == 0


def test_one_rank_replica_reserves_its_cpus_and_gpu():
    assert replica_resources(1, 2, num_gpus=None) == {"ray_actor_options": {"num_cpus": 2}}
    assert replica_resources(1, 2, num_gpus=1) == {
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}
    }
    # Two replicas sharing one GPU.
    assert replica_resources(1, 2, num_gpus=0.5) == {
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}
    }


def test_tensor_parallel_replica_reserves_its_gpus_in_one_placement_group_bundle():
    options = replica_resources(4, 2, num_gpus=4)
    assert options["placement_group_bundles"] == [{"CPU": 8, "GPU": 4}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 4}
    on_cpu = replica_resources(2, 1, num_gpus=None)  # ranks as processes (gloo)
    assert on_cpu["placement_group_bundles"] == [{"CPU": 2}]


def test_prefix_keys_name_a_prompts_full_chunks_whatever_its_form():
    ids = list(range(1000, 1000 + 3 * PREFIX_CHUNK_TOKENS + 5))
    keys = prefix_keys(GenerateRequest("a", prompt=ids))
    assert len(keys) == 3
    longer = prefix_keys(GenerateRequest("b", prompt=ids + [7] * PREFIX_CHUNK_TOKENS))
    assert longer[:3] == keys and len(longer) == 4
    assert prefix_keys(GenerateRequest("c", prompt=[5, *ids[1:]]))[0] != keys[0]
    text = "x" * (2 * PREFIX_CHUNK_CHARS)
    assert len(prefix_keys(GenerateRequest("d", prompt=text))) == 2
    turn = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    next_turn = [*turn, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    first = prefix_keys(GenerateRequest("e", messages=turn))
    assert prefix_keys(GenerateRequest("f", messages=next_turn))[: len(first)] == first
    assert prefix_keys(GenerateRequest("g", prompt=ids[: PREFIX_CHUNK_TOKENS - 1])) == []


def test_a_prompt_goes_where_its_prefix_is_when_that_replica_can_admit_it():
    owners = PrefixOwners()
    roomy, busy = rank_key(stats(0.8), 0), rank_key(stats(0.4, running=5), 5)
    document = [1, 2, 3]
    # First seen: the KV ranking decides, and the prefix is remembered there.
    assert route({"r0": busy, "r1": roomy}, document, owners) == ["r1", "r0"]
    # The next turn (the same chunks and more) goes back to r1 even when r0 has more room now.
    assert route({"r0": roomy, "r1": busy}, [*document, 4], owners) == ["r1", "r0"]
    # A prompt sharing only its first chunk goes there too; a new prompt follows the ranking.
    assert route({"r0": roomy, "r1": busy}, [1, 9], owners)[0] == "r1"
    assert route({"r0": roomy, "r1": busy}, [8], owners)[0] == "r0"


def test_the_owner_keeps_its_prompts_behind_a_short_queue_while_its_kv_has_room():
    """A loaded replica spacing its admissions has a request or two waiting most of the time;
    its chats' next turns still go to it (their prefixes are there), but not behind a longer
    queue, nor once its KV cache has no room for one more."""
    owners = PrefixOwners()
    idle = rank_key(stats(0.9), 0)
    route({"r0": rank_key(stats(0.5), 0), "r1": idle}, [1, 2], owners)  # r0 has more room
    assert owners.longest([1, 2], {"r0", "r1"}) == "r1"
    for waiting, free, goes_to in [(1, 0.4, "r1"), (2, 0.4, "r1"), (3, 0.4, "r0"), (1, 0.02, "r0")]:
        loaded = rank_key(stats(free, running=20, waiting=waiting), 20 + waiting)
        assert route({"r0": idle, "r1": loaded}, [1, 2, 3], owners)[0] == goes_to, (waiting, free)
        owners.assign([1, 2, 3], "r1")


def test_a_full_owner_loses_the_prompt_and_the_prefix_moves_with_it():
    owners = PrefixOwners()
    full = rank_key(stats(0.01, 0.1, running=9), 9)
    route({"r0": rank_key(stats(0.9), 0), "r1": rank_key(stats(0.5), 0)}, [1, 2], owners)
    assert route({"r0": full, "r1": rank_key(stats(0.5), 0)}, [1, 2, 3], owners)[0] == "r1"
    assert owners.longest([1, 2, 3], {"r0", "r1"}) == "r1"
    # A replica gone (not a candidate) owns nothing.
    assert owners.longest([1, 2, 3], {"r0"}) is None


def test_a_burst_of_new_prompts_is_spread_by_the_routers_own_count_until_a_report():
    """Six chats' first turns routed at once to two replicas that have not reported (Serve's
    queue-length count still 0 for both) go 3 and 3, not all to the first; a report then
    starts the count again, and a report that has not changed does not."""
    sent, owners = SentSinceReport(), PrefixOwners()
    reports: dict[str, dict | None] = {"r0": None, "r1": None}

    def route_one(prompt: list[int]) -> str:
        ranks = {r: rank_key(None, 0, sent.count(r, reports[r])) for r in reports}
        chosen = route(ranks, prompt, owners)[0]
        sent.add(chosen)
        return chosen

    chosen = [route_one([chat]) for chat in range(6)]
    assert sorted(chosen.count(r) for r in reports) == [3, 3]
    report = {"kv_free_fraction": 0.9}
    reports["r0"] = report
    assert sent.count("r0", report) == 0 and sent.count("r1", None) == 3
    sent.add("r0")
    assert sent.count("r0", dict(report)) == 1  # the same report again: still counting
    sent.keep({"r1"})  # r0 stopped
    assert sent.count("r0", report) == 0


def test_prefix_owners_forget_the_least_recently_used_first():
    owners = PrefixOwners(capacity=3)
    owners.assign([1, 2], "r0")
    owners.assign([3], "r1")
    owners.longest([1], {"r0"})  # a lookup does not refresh
    owners.assign([1], "r0")  # an assignment does
    owners.assign([4], "r1")  # evicts 2, the oldest
    assert owners.longest([2], {"r0", "r1"}) is None
    assert [owners.longest([k], {"r0", "r1"}) for k in (1, 3, 4)] == ["r0", "r1", "r1"]
