"""Routing LoRA traffic over many replicas, simulated: each replica an engine with our scheduler's rules (up to
max_num_seqs running, an adapter per device slot pinned while a request uses it, the host tier an LRU of adapters),
step times and adapter costs from our own measurements (Costs), and a router that picks a replica per request.

Policies: round-robin; adapter-affinity hashing (a consistent-hash ring, as nginx's `hash ... consistent`); and
affinity with least-load spill-over (the inference gateway's way): among the replicas whose queue is within a
threshold of the shortest, one that has the adapter in its device tier, else in its host tier, else the adapter's
ring owner, else the least loaded.
"""
import bisect
import hashlib
import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Costs:
    """Seconds. A decode step of b rows over k distinct adapters: step_s + row_s b, and when k > 0 also
    lora_s + lora_row_s b + adapter_s k."""
    step_s: float
    row_s: float
    lora_s: float
    lora_row_s: float
    adapter_s: float
    prefill_token_s: float                    # a prompt token in a prompt step
    host_upload_s: float                      # an adapter's weights into the host tier (transfer and parse)
    device_load_s: float                      # an adapter from the host tier into a device slot

    def decode_step(self, rows: int, adapters: int) -> float:
        if rows == 0:
            return 0.0
        lora = self.lora_s + self.lora_row_s * rows + self.adapter_s * adapters if adapters else 0.0
        return self.step_s + self.row_s * rows + lora


@dataclass(eq=False)
class Request:
    arrival: float
    adapter: int
    prompt: int
    output: int
    ready: float = 0.0                        # when its adapter is in the host tier (after an upload)
    first_token: float | None = None
    device_hit: bool = False
    host_hit: bool = False
    left: int = 0


@dataclass(eq=False)
class Replica:
    index: int
    max_seqs: int
    max_loras: int
    host_adapters: int
    costs: Costs
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    device: OrderedDict = field(default_factory=OrderedDict)     # adapter -> pins, least recently used first
    host: OrderedDict = field(default_factory=OrderedDict)       # adapter -> None, least recently used first
    stepping: bool = False                    # a step is under way (else idle, or asleep until an upload is done)
    epoch: int = 0                            # of its latest scheduled event: earlier ones are stale
    served: int = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def enqueue(self, req: Request, now: float) -> None:
        req.host_hit = req.adapter in self.host
        req.ready = now if req.host_hit else now + self.costs.host_upload_s
        if req.host_hit:
            self.host.move_to_end(req.adapter)
        else:
            self.host[req.adapter] = None
            in_use = {r.adapter for r in self.running} | {r.adapter for r in self.waiting}
            while len(self.host) > self.host_adapters:
                victim = next((a for a in self.host if a not in in_use), None)
                if victim is None:
                    break
                del self.host[victim]
                self.device.pop(victim, None)                # the device tier holds only what the host has
        self.waiting.append(req)

    def step(self, now: float) -> float:
        """Run one step from `now`: admit what fits, prefill it, decode the rest; its duration (0: nothing to do)."""
        cost, prompt_tokens, skipped = 0.0, 0, deque()
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting.popleft()
            if req.ready > now or not self._acquire(req):
                skipped.append(req)                          # later requests may still start
                continue
            cost += 0.0 if req.device_hit else self.costs.device_load_s
            prompt_tokens += req.prompt
            req.left = req.output
            self.running.append(req)
        self.waiting.extendleft(reversed(skipped))
        if not self.running:
            return 0.0
        adapters = len({r.adapter for r in self.running})
        cost += prompt_tokens * self.costs.prefill_token_s + self.costs.decode_step(len(self.running), adapters)
        end = now + cost
        for req in self.running:
            req.left -= 1
            if req.first_token is None:
                req.first_token = end
        for req in [r for r in self.running if r.left <= 0]:
            self.running.remove(req)
            self.device[req.adapter] -= 1
            self.served += 1
        return cost

    def _acquire(self, req: Request) -> bool:
        if req.adapter in self.device:
            req.device_hit = True
        elif len(self.device) >= self.max_loras:
            idle = next((a for a, pins in self.device.items() if pins == 0), None)
            if idle is None:
                return False
            del self.device[idle]
        self.device[req.adapter] = self.device.get(req.adapter, 0) + 1
        self.device.move_to_end(req.adapter)
        return True

    def next_ready(self) -> float | None:
        return min((r.ready for r in self.waiting), default=None)


class Ring:
    """A consistent-hash ring: each replica at `points` places; an adapter goes to the next place clockwise."""

    def __init__(self, num_replicas: int, points: int = 100):
        self.keys, self.owners = [], []
        for key, owner in sorted((_hash(f"{r}-{p}"), r) for r in range(num_replicas) for p in range(points)):
            self.keys.append(key)
            self.owners.append(owner)

    def owner(self, adapter: int) -> int:
        return self.owners[bisect.bisect(self.keys, _hash(f"adapter{adapter}")) % len(self.keys)]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "big")


def route(policy: str, req: Request, replicas: list[Replica], loads: np.ndarray, ring: Ring, counter: list[int],
          spill: int) -> int:
    if policy == "round-robin":
        counter[0] += 1
        return counter[0] % len(replicas)
    owner = ring.owner(req.adapter)
    if policy == "affinity":
        return owner
    candidates = np.flatnonzero(loads <= loads.min() + spill)
    for tier in ("device", "host"):
        holding = [int(r) for r in candidates if req.adapter in getattr(replicas[r], tier)]
        if holding:
            return min(holding, key=lambda r: loads[r])
    if loads[owner] <= loads.min() + spill:
        return owner
    return int(candidates[np.argmin(loads[candidates])])


@dataclass
class Scenario:
    num_replicas: int
    num_adapters: int = 5000
    zipf_s: float = 1.1
    rate_per_replica: float = 4.0             # requests per second
    duration_s: float = 20.0
    prompt: int = 128
    output: int = 64
    max_seqs: int = 32
    max_loras: int = 8
    host_adapters: int = 64
    spill: int = 8                            # affinity-spill: queue slack before a request leaves its adapter
    seed: int = 0


def requests(sc: Scenario) -> list[Request]:
    """Poisson arrivals, adapters by Zipf popularity (rank 1 the most asked)."""
    rng = random.Random(sc.seed)
    weights = np.arange(1, sc.num_adapters + 1, dtype=float) ** -sc.zipf_s
    cdf = np.cumsum(weights / weights.sum())
    out, t, rate = [], 0.0, sc.rate_per_replica * sc.num_replicas
    while True:
        t += rng.expovariate(rate)
        if t > sc.duration_s:
            return out
        adapter = int(np.searchsorted(cdf, rng.random()))
        out.append(Request(t, adapter, sc.prompt, sc.output))


def simulate(sc: Scenario, policy: str, costs: Costs, reqs: list[Request] | None = None) -> dict:
    reqs = [Request(r.arrival, r.adapter, r.prompt, r.output) for r in (reqs or requests(sc))]
    replicas = [Replica(i, sc.max_seqs, sc.max_loras, sc.host_adapters, costs) for i in range(sc.num_replicas)]
    loads = np.zeros(sc.num_replicas)
    ring, counter = Ring(sc.num_replicas), [-1]
    events = [(r.arrival, 0, i, 0) for i, r in enumerate(reqs)]    # (time, 0 arrival / 1 step end, index, epoch)
    heapq.heapify(events)
    while events:
        now, kind, index, epoch = heapq.heappop(events)
        if kind == 0:
            req = reqs[index]
            replica = replicas[route(policy, req, replicas, loads, ring, counter, sc.spill)]
            replica.enqueue(req, now)
            loads[replica.index] = replica.load
            if replica.stepping:
                continue
        else:
            replica = replicas[index]
            if epoch != replica.epoch:                        # a wake-up an arrival overtook
                continue
        duration = replica.step(now)
        replica.stepping = duration > 0
        replica.epoch += 1
        if duration > 0:
            heapq.heappush(events, (now + duration, 1, replica.index, replica.epoch))
        elif replica.waiting:                                 # only requests whose upload is not done yet
            heapq.heappush(events, (replica.next_ready(), 1, replica.index, replica.epoch))
        loads[replica.index] = replica.load
    return summarize(reqs, replicas)


def summarize(reqs: list[Request], replicas: list[Replica]) -> dict:
    ttft = np.array([r.first_token - r.arrival for r in reqs if r.first_token is not None])
    served = np.array([r.served for r in replicas], dtype=float)
    return {"requests": len(reqs), "device_hit_rate": float(np.mean([r.device_hit for r in reqs])),
            "host_hit_rate": float(np.mean([r.host_hit for r in reqs])),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "load_imbalance": float(served.max() / served.mean()) if served.mean() else 0.0,
            "unfinished": int(sum(r.first_token is None for r in reqs))}
