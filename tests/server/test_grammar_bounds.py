"""Grammars compile off the request path, bounded: a schema that takes xgrammar long (nested hundreds deep) delays no
other request, is refused by name once it passes guided_decoding_compile_timeout_s (or its memory bound), and stops
when its request is stopped."""
import threading
import time

import numpy as np

from tests.helpers import nested_schema, random_prompts
from tests.server.streams import Stream, run, trtllm_inputs

TIMEOUT_S = 5.0                                # the model parameter's default
WORKER_START_S = 15.0                          # one of two compiles at once starts a worker first: its start is not
                                               # the compile's time but is the client's (3.7 s seen on 2 busy cores,
                                               # 8.7 s once beside a full CI run)


def guided(schema: str, max_tokens: int = 4) -> dict:
    return trtllm_inputs([1, 2, 3], max_tokens, True, guided_decoding_guide_type=np.array([["json_schema"]], object),
                         guided_decoding_guide=np.array([[schema]], object))


def test_a_deep_schema_delays_no_other_request_and_is_refused_at_the_time_limit(smollm2_server):
    url = smollm2_server.grpc_url
    prompt = random_prompts([16], 49152, seed=71)[0]
    results: dict[int, object] = {}

    def deep(depth: int) -> None:
        started = time.monotonic()
        results[depth] = (run(url, guided(nested_schema(depth))), time.monotonic() - started)

    threads = [threading.Thread(target=deep, args=(depth,)) for depth in (400, 2000)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)                                            # both compiling now
    started = time.monotonic()
    stream = Stream(url).send(trtllm_inputs(prompt, 4, True))
    stream.wait_first()
    first_token_s = time.monotonic() - started
    normal = stream.collect()
    stream.close()
    assert normal.error is None and len(normal.tokens) == 4
    assert first_token_s < 1.0, f"a normal request waited {first_token_s:.2f} s behind a grammar compile"
    for thread in threads:
        thread.join(timeout=60)
    for depth in (400, 2000):
        result, seconds = results[depth]
        assert result.error.startswith("guided_decoding_guide: its compile passed guided_decoding_compile_")
        assert seconds < TIMEOUT_S + WORKER_START_S
    assert run(url, guided(nested_schema(3), 8)).error is None  # the workers serve on


def test_a_stopped_request_stops_its_compile(smollm2_server):
    url = smollm2_server.grpc_url
    stream = Stream(url).send(guided(nested_schema(405)), request_id="deep-stop")   # seconds, and memory slowly
    time.sleep(0.3)
    started = time.monotonic()
    stop = run(url, trtllm_inputs([0], 1, True, stop=np.array([[True]])), request_id="deep-stop")
    result = stream.collect(timeout_s=30)
    stream.close()
    assert stop.error is None and result.error is None and result.num_final == 1
    assert time.monotonic() - started < 2.0


def test_a_small_grammar_is_not_queued_behind_costly_ones_and_those_are_refused_again_at_once(smollm2_server):
    """Four schemas that run to the time limit and a small one sent after them, on two workers: the small one is
    served before the last costly one is refused (tests/backend/guided/test_grammar_worker.py checks the order exactly: here
    a worker's start, niced below two busy engines, takes seconds of wall time that a compile's bound does not wait
    for), and a costly one sent again is refused at once."""
    url = smollm2_server.grpc_url
    results: dict[str, tuple] = {}

    def send(name: str, schema: str) -> None:
        started = time.monotonic()
        result = run(url, guided(schema))
        results[name] = (result, time.monotonic() - started, time.monotonic())

    costly = {f"deep{depth}": nested_schema(depth) for depth in (401, 402, 403, 404)}
    threads = [threading.Thread(target=send, args=item) for item in costly.items()]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    time.sleep(0.5)
    small = threading.Thread(target=send, args=("small", nested_schema(2).replace('"a"', '"small"')))
    small.start()
    for thread in threads + [small]:
        thread.join(timeout=120)
    result, seconds, small_done = results["small"]
    assert result.error is None and len(result.tokens) == 4
    refused_at = sorted(done for name, (r, _, done) in results.items() if name != "small")
    print(f"small: {seconds:.1f} s; costly refused after " + ", ".join(
        f"{results[name][1]:.1f}" for name in sorted(costly, key=lambda name: results[name][2])) + " s")
    assert all(results[name][0].error.startswith("guided_decoding_guide: its compile passed") for name in costly)
    assert small_done < refused_at[3], "the small grammar waited behind every costly one"
    started = time.monotonic()
    again = run(url, guided(costly["deep401"]))
    assert again.error == results["deep401"][0].error and time.monotonic() - started < 1.0
