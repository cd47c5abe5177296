"""The heartbeat stops while a watched call runs too long (a stub's call into tritonserver that its deadlocked gRPC
frontend never returns, an engine's stuck step), says so once on stderr, and beats again once it ends."""
import threading
import time

from backend.serving.heartbeat import Heartbeat, InFlight


def test_in_flight_calls_report_the_oldest_start():
    calls = InFlight()
    assert calls.oldest() is None
    inside, release = threading.Event(), threading.Event()

    def hold():
        with calls.call():
            inside.set()
            release.wait()
    worker = threading.Thread(target=hold)
    before = time.monotonic()
    worker.start()
    inside.wait()
    with calls.call():
        assert before <= calls.oldest() <= time.monotonic() and len(calls.starts) == 2
        first = calls.oldest()
    assert calls.oldest() == first and len(calls.starts) == 1                # the other thread's call still runs
    release.set()
    worker.join()
    assert calls.oldest() is None


def test_the_stuck_call_hook_holds_one_call_forever(tmp_path):
    """inject_stuck_call_file: once the file exists, the next call takes it and never returns (still watched);
    calls before and after run as usual."""
    stuck = tmp_path / "stuck"
    calls, done = InFlight(str(stuck)), []

    def call():
        with calls.call():
            done.append(threading.get_ident())
    call()
    stuck.touch()
    held = threading.Thread(target=call, daemon=True)
    held.start()
    held.join(timeout=0.5)
    assert held.is_alive() and not stuck.exists() and calls.oldest() is not None
    call()
    assert len(done) == 2 and held.ident not in done


def test_a_call_that_runs_too_long_stops_the_heartbeat_until_it_ends(capfd):
    calls, beats = InFlight(), []
    heartbeat = Heartbeat(beats.append, lambda: True, calls.oldest, period_s=0.02, max_step_s=0.3,
                          what="a call into the server").start()
    try:
        time.sleep(0.2)
        assert beats                                                          # idle: beating
        with calls.call():
            time.sleep(0.45)
            stopped_at = len(beats)
            time.sleep(0.4)
            assert len(beats) == stopped_at                                   # past max_step_s: silent
        time.sleep(0.2)
        assert len(beats) > stopped_at                                        # it ended: beating again
    finally:
        heartbeat.stop()
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[heartbeat]")]
    assert len(said) == 1 and "a call into the server has run" in said[0] and "over 0.3" in said[0]
