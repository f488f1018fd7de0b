"""The KV-capacity ranking of the Ray request router, and what a replica reserves."""

from __future__ import annotations

from service.messages import RoutingStats
from service.ray_app import replica_resources
from service.router import rank_key


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
