"""bench/routing.py on toy cases computed by hand: two replicas, steps of one second, free adapter costs."""
import numpy as np
import pytest

from bench.routing import Costs, Replica, Request, Ring, Scenario, requests, route, simulate

ONE_SECOND_STEPS = Costs(step_s=1.0, row_s=0.0, lora_s=0.0, lora_row_s=0.0, adapter_s=0.0, prefill_token_s=0.0,
                         host_upload_s=0.0, device_load_s=0.0)


def toy(policy: str, adapters: list[int], costs: Costs = ONE_SECOND_STEPS) -> dict:
    reqs = [Request(0.0, a, prompt=4, output=1) for a in adapters]
    return simulate(Scenario(2, num_adapters=10, max_seqs=1, max_loras=1, host_adapters=4, spill=0), policy, costs,
                    reqs)


def test_decode_step_costs():
    costs = Costs(1.0, 0.5, 0.25, 0.125, 0.0625, 0.0, 0.0, 0.0)
    assert costs.decode_step(0, 0) == 0.0
    assert costs.decode_step(4, 0) == 1.0 + 4 * 0.5
    assert costs.decode_step(4, 2) == 1.0 + 4 * 0.5 + 0.25 + 4 * 0.125 + 2 * 0.0625


def test_round_robin_alternates_and_queues_behind_a_busy_replica():
    # requests 0 and 2 go to replica 0, request 1 to replica 1; one seat each: request 2 waits one step
    res = toy("round-robin", [7, 7, 8])
    assert res["ttft_p50_s"] == 1.0 and res["ttft_p99_s"] == pytest.approx(2.0, abs=0.05)
    assert res["device_hit_rate"] == 0.0 and res["load_imbalance"] == pytest.approx(2 / 1.5)


def test_affinity_sends_an_adapter_to_its_owner_where_it_is_warm():
    # both requests of adapter 7 go to its owner: the second waits a step and finds the adapter in the device slot
    res = toy("affinity", [7, 7])
    assert res["device_hit_rate"] == 0.5 and res["host_hit_rate"] == 0.5
    assert res["ttft_p50_s"] == 1.5 and res["ttft_p99_s"] == pytest.approx(2.0, abs=0.05)   # TTFTs 1 and 2 s
    assert res["load_imbalance"] == 2.0


def test_spill_over_leaves_a_busy_owner_for_an_idle_replica():
    ring = Ring(2)
    owner = ring.owner(7)
    replicas = [Replica(i, 32, 8, 64, ONE_SECOND_STEPS) for i in range(2)]
    req = Request(0.0, 7, 4, 1)
    loads = np.zeros(2)
    assert route("affinity-spill", req, replicas, loads, ring, [0], spill=2) == owner      # equal loads: the owner
    loads[owner] = 3
    assert route("affinity-spill", req, replicas, loads, ring, [0], spill=2) == 1 - owner  # past the slack: spill
    replicas[owner].device[7] = 0
    loads[owner] = 2
    assert route("affinity-spill", req, replicas, loads, ring, [0], spill=2) == owner      # warm, within the slack
    replicas[1 - owner].host[7] = None
    loads[owner] = 5
    assert route("affinity-spill", req, replicas, loads, ring, [0], spill=2) == 1 - owner  # the host tier next


def test_an_upload_delays_only_its_own_request():
    costs = Costs(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, host_upload_s=0.5, device_load_s=0.0)
    res = toy("affinity", [7], costs)
    assert res["ttft_p50_s"] == pytest.approx(1.5) and res["host_hit_rate"] == 0.0


def test_requests_follow_zipf_popularity_and_the_rate():
    reqs = requests(Scenario(4, num_adapters=100, zipf_s=1.1, rate_per_replica=50.0, duration_s=10.0))
    assert len(reqs) == pytest.approx(2000, rel=0.1)
    counts = np.bincount([r.adapter for r in reqs], minlength=100)
    assert counts[0] == counts.max() and counts[0] > 5 * counts[50]
