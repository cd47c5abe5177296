"""The grammar workers (backend/guided/worker.py) with real xgrammar processes on SmolLM2's tokenizer: a costly
compile is refused by name at its bound and again at once when resent, a compile that succeeds is answered from the
cache, and with one worker the waiting compiles go shortest guide first, whatever their order of arrival."""
import json
import threading
import time

import pytest

from backend.core.request import RequestError
from backend.guided.worker import GrammarWorkers
from backend.text import tokenizer_from_dir
from tests.helpers import nested_schema

TIME_LIMIT_S = 1.5


@pytest.fixture(scope="module")
def workers(smollm2_dir):
    import xgrammar
    vocab_size = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer_from_dir(str(smollm2_dir)), vocab_size=vocab_size)
    workers = GrammarWorkers(str(smollm2_dir), vocab_size, info, time_limit_s=TIME_LIMIT_S, max_workers=1)
    yield workers
    workers.close()


def compile_timed(workers: GrammarWorkers, schema: str) -> tuple[object, float]:
    """(the grammar or the RequestError, when it was answered)"""
    try:
        result = workers.compile("json_schema", schema)
    except RequestError as err:
        result = err
    return result, time.monotonic()


def test_waiting_compiles_go_shortest_first_and_a_refused_grammar_is_refused_again_at_once(workers):
    """One worker, a costly schema compiling, then two more costly ones and a small one arrive in that order: the
    small one takes the worker as soon as the first is refused, before the two costly ones that came before it."""
    schemas = {"costly1": nested_schema(401), "costly2": nested_schema(402), "costly3": nested_schema(403),
               "small": nested_schema(2).replace('"a"', '"small"')}
    answered: dict[str, tuple[object, float]] = {}

    def send(name: str) -> None:
        answered[name] = compile_timed(workers, schemas[name])

    threads = [threading.Thread(target=send, args=(name,)) for name in schemas]
    for thread in threads:
        thread.start()
        time.sleep(0.1)                                  # arrivals in order; the first compiles meanwhile
    for thread in threads:
        thread.join(timeout=120)
    order = sorted(answered, key=lambda name: answered[name][1])
    assert order[:2] == ["costly1", "small"], order
    assert not isinstance(answered["small"][0], RequestError)
    for name in ("costly1", "costly2", "costly3"):
        assert str(answered[name][0]).startswith("guided_decoding_guide: its compile passed guided_decoding_compile_")
    started = time.monotonic()
    again, _ = compile_timed(workers, schemas["costly2"])
    assert str(again) == str(answered["costly2"][0]) and time.monotonic() - started < 0.1
    started = time.monotonic()
    assert workers.compile("json_schema", schemas["small"]) is answered["small"][0]     # from the cache
    assert time.monotonic() - started < 0.1


def test_a_guide_that_does_not_compile_is_refused_by_name_and_the_worker_serves_on(workers):
    with pytest.raises(RequestError, match="guided_decoding_guide: does not compile as regex"):
        workers.compile("regex", "[a-")
    assert workers.compile("regex", "[a-z]{3}") is not None
