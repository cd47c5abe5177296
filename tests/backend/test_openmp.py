"""The OpenMP runtime's settings per thread: releasing a pool, a team of one for side work, and the stepping
thread's team sized to the cores it gets (a fake clock and run-queue reading drive the policy; the team size it
sets is libgomp's own, read back)."""
import os
import threading

import pytest
import torch

import backend.openmp as openmp


def test_releasing_the_openmp_pool_ends_this_threads_workers_until_its_next_parallel_op(openmp_pool_of_two):
    from tests.helpers import num_threads, settled_num_threads
    with_pool = num_threads()
    openmp.release_openmp_pool()
    assert settled_num_threads(with_pool - 1) == with_pool - 1
    openmp.release_openmp_pool()                                  # nothing left to release: a no-op
    assert num_threads() == with_pool - 1
    torch.ones(1 << 22).sum()
    assert num_threads() == with_pool


def test_one_openmp_thread_holds_for_this_thread_only_and_ends_with_the_block(openmp_pool_of_two):
    seen = []
    with openmp.one_openmp_thread():
        seen.append(torch.get_num_threads())
        other = threading.Thread(target=lambda: seen.append(openmp._libgomp().omp_get_max_threads()))
        other.start()
        other.join()
    assert seen[0] == 1 and seen[1] > 1
    assert torch.get_num_threads() == 2


class FakeClock:
    """Both clocks the sizer reads, the thread's run-queue wait and the machine's idle core time: `run` passes time
    on a step, waiting for a core `waiting` of it, with `idle` cores idle meanwhile."""

    def __init__(self):
        self.now = 0.0
        self.waited = 0.0
        self.idle = 0.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def run(self, seconds: float, waiting: float = 0.0, idle: float = 0.0) -> None:
        self.now += seconds
        self.waited += seconds * waiting
        self.idle += seconds * idle


@pytest.fixture()
def clock(monkeypatch):
    if openmp._libgomp() is None:
        pytest.skip("torch does not run its CPU ops on GNU OpenMP here")
    fake = FakeClock()
    monkeypatch.setattr(openmp, "time", fake)
    monkeypatch.setattr(openmp, "_run_queue_wait_s", lambda: fake.waited)
    monkeypatch.setattr(openmp, "_idle_core_s", lambda: fake.idle)
    return fake


def on_a_thread_with_two(scenario) -> None:
    """Run scenario() on a fresh thread whose OpenMP team is 2 (libgomp keeps it per thread: this one's stays)."""
    errors = []

    def body():
        openmp._libgomp().omp_set_num_threads(2)
        try:
            scenario()
        except BaseException as exc:                          # noqa: B036 (re-raised on the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def step(sizer: openmp.TeamSizer, clock: FakeClock, seconds: float, waiting: float = 0.0, idle: float = 0.0) -> None:
    sizer.start()
    clock.run(seconds, waiting, idle)
    sizer.checkpoint()


def test_a_crowded_core_shrinks_the_team_and_a_try_after_the_hold_grows_it_again(clock):
    def scenario():
        gomp = openmp._libgomp()
        sizer = openmp.TeamSizer()
        step(sizer, clock, 0.25)
        assert (sizer.num_threads, gomp.omp_get_max_threads()) == (2, 2)
        step(sizer, clock, 0.25, waiting=0.4)                 # 40% of a step waiting for a core
        assert (sizer.num_threads, gomp.omp_get_max_threads(), sizer.num_reductions) == (1, 1, 1)
        step(sizer, clock, 0.25, waiting=0.4)                 # one thread cannot shrink further
        step(sizer, clock, 0.45)
        assert sizer.num_threads == 1                         # held: 1 s since the reduction (at t=0.5)
        step(sizer, clock, 0.3)
        assert (sizer.num_threads, gomp.omp_get_max_threads()) == (2, 2)       # the try
        step(sizer, clock, 0.25, waiting=0.5)                 # still crowded: back to one, held twice as long
        assert (sizer.num_threads, sizer.hold_s) == (1, 2.0)
        step(sizer, clock, 1.9)
        assert sizer.num_threads == 1
        step(sizer, clock, 0.25)
        assert sizer.num_threads == 2
        step(sizer, clock, 0.25)                              # the try held: the hold is back to its start
        assert (sizer.num_threads, sizer.hold_s) == (2, 1.0)
    on_a_thread_with_two(scenario)


def test_idle_cores_grow_a_smaller_team_before_its_hold_ends(clock):
    def scenario():
        sizer = openmp.TeamSizer()
        step(sizer, clock, 0.25, waiting=0.4)
        assert sizer.num_threads == 1
        step(sizer, clock, 0.25, idle=0.3)                    # under half a core idle: the other work goes on
        assert sizer.num_threads == 1
        clock.run(0.2, idle=2.0)                              # between steps: not counted
        step(sizer, clock, 0.25, idle=0.3)
        assert sizer.num_threads == 1
        step(sizer, clock, 0.25, idle=0.9)                    # the other work is gone, 0.95 s into the 1 s hold
        assert (sizer.num_threads, openmp._libgomp().omp_get_max_threads()) == (2, 2)
        step(sizer, clock, 0.25, waiting=0.5)                 # it came back: the cores read busy, trust kept
        assert sizer.num_threads == 1
        step(sizer, clock, 0.25, idle=0.9)
        assert sizer.num_threads == 2
    on_a_thread_with_two(scenario)


def test_a_try_on_idle_cores_that_waits_while_they_read_idle_stops_trusting_the_idle_time(clock):
    def scenario():
        sizer = openmp.TeamSizer()                            # as under a CPU quota: idle cores it cannot have
        step(sizer, clock, 0.25, waiting=0.4, idle=1.0)
        step(sizer, clock, 0.25, idle=1.0)
        assert sizer.num_threads == 2                         # the try on idle cores
        step(sizer, clock, 0.25, waiting=0.4, idle=1.0)
        assert (sizer.num_threads, sizer.hold_s) == (1, 2.0)
        step(sizer, clock, 1.5, idle=1.0)                     # idle, but no longer believed: the hold runs
        assert sizer.num_threads == 1
        step(sizer, clock, 0.6, idle=1.0)
        assert sizer.num_threads == 2
    on_a_thread_with_two(scenario)


def test_only_step_time_is_judged_over_a_whole_interval(clock):
    def scenario():
        sizer = openmp.TeamSizer(interval_s=0.2)
        step(sizer, clock, 0.1, waiting=0.3)                  # half an interval: no judgement yet
        clock.run(5.0, waiting=1.0)                           # between steps: not counted
        step(sizer, clock, 0.15)                              # 0.03 s waited in 0.25 s of steps
        assert (sizer.num_threads, sizer.num_reductions) == (2, 0)
        step(sizer, clock, 0.05, waiting=0.9)
        step(sizer, clock, 0.005, waiting=1.0)                # too soon after the last reading: not read
        assert sizer.num_threads == 2
        step(sizer, clock, 0.15, waiting=0.9)
        assert sizer.num_threads == 1
    on_a_thread_with_two(scenario)


def test_another_stepping_thread_or_a_team_set_elsewhere_starts_the_sizer_afresh(clock):
    sizer = openmp.TeamSizer()

    def crowded():
        step(sizer, clock, 0.25, waiting=0.5)
        assert sizer.num_threads == 1
    on_a_thread_with_two(crowded)
    on_a_thread_with_two(lambda: (sizer.start(), clock.run(0.01)))          # Python may reuse the first's id
    assert (sizer.max_threads, sizer.num_threads) == (2, 2)

    def set_by_someone_else():
        step(sizer, clock, 0.25, waiting=0.5)
        openmp._libgomp().omp_set_num_threads(2)              # as torch.set_num_threads does, for this thread
        step(sizer, clock, 0.01)
        assert (sizer.max_threads, sizer.num_threads) == (2, 2)
    on_a_thread_with_two(set_by_someone_else)


def test_an_inactive_sizer_never_touches_the_team(clock):
    def scenario():
        sizer = openmp.TeamSizer(active=False)
        step(sizer, clock, 0.25, waiting=0.9)
        assert not sizer.active and openmp._libgomp().omp_get_max_threads() == 2
    on_a_thread_with_two(scenario)


def test_the_run_queue_wait_is_read_from_linux():
    waited = openmp._run_queue_wait_s()
    if waited is None:
        pytest.skip("no /proc/thread-self/schedstat on this system")
    torch.ones(1 << 20).sum()
    assert 0.0 <= waited <= openmp._run_queue_wait_s()


def test_each_thread_reads_its_own_schedstat_through_a_kept_descriptor():
    if openmp._run_queue_wait_s() is None:
        pytest.skip("no /proc/thread-self/schedstat on this system")
    seen = {}

    def read():
        openmp._run_queue_wait_s()
        openmp._run_queue_wait_s()                               # the second read reuses the first's descriptor
        fd = openmp._kept.schedstat.fileno()
        seen[threading.get_native_id()] = os.readlink(f"/proc/self/fd/{fd}")
    read()
    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert len(seen) == 2
    for tid, target in seen.items():
        assert target.endswith(f"/task/{tid}/schedstat")


def test_a_forked_child_reads_its_own_schedstat():
    if openmp._run_queue_wait_s() is None:
        pytest.skip("no /proc/thread-self/schedstat on this system")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                                  # the child: nothing but the reading
        openmp._run_queue_wait_s()
        os.write(write, os.readlink(f"/proc/self/fd/{openmp._kept.schedstat.fileno()}").encode())
        os._exit(0)
    os.close(write)
    target = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert target.endswith(f"/task/{pid}/schedstat")              # the child's main thread's id is its pid


def test_the_idle_core_time_is_the_idle_time_of_proc_stat():
    idle = openmp._idle_core_s()
    if idle is None:
        pytest.skip("no /proc/uptime on this system")
    with open("/proc/stat") as f:
        stat_idle = int(f.readline().split()[4]) / os.sysconf("SC_CLK_TCK")
    assert abs(openmp._idle_core_s() - stat_idle) < 0.5 and openmp._idle_core_s() >= idle


def test_an_eager_cpu_step_asks_the_sizer_after_every_layer(tiny_model_dir, monkeypatch):
    from backend import LLMEngine
    engine = LLMEngine(tiny_model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
    if not engine.runner.team.active:
        pytest.skip("no GNU OpenMP or no schedstat here: the team keeps its size")
    calls = []
    monkeypatch.setattr(engine.runner.team, "checkpoint", lambda: calls.append(1))
    engine.generate([[5, 6, 7]], max_new_tokens=1)
    assert len(calls) == engine.model_config.num_layers + 1          # and once as the step ends
