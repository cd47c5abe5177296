"""A choice's streamed text: the detokenized tokens, cut before the first stop string, which is never streamed."""
import random

import pytest

from frontend.choice import Choice


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


TEXT = "The sea is vast, and the sea is deep.\nWaves: é, 東京, and END of line. The end."


def stream(choice: Choice, ids: list[int], chunk: int) -> list[str]:
    pieces = []
    for i in range(0, len(ids), chunk):
        pieces.append(choice.add(ids[i:i + chunk], [0.0] * len(ids[i:i + chunk])).text)
        if choice.stopped:
            break
    pieces.append(choice.finish().text)
    return pieces


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("stop", [[], ["sea is deep"], ["END", "vast"], ["東京"], ["e."], ["no such text"]])
def test_streamed_text_is_the_decoded_text_cut_before_the_first_stop(tokenizer, stop, chunk):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(ids)
    cut = min([full.index(s) for s in stop if s in full], default=len(full))
    choice = Choice(0, tokenizer, max_tokens=1000, stop=stop)
    pieces = stream(choice, ids, chunk)
    assert "".join(pieces) == full[:cut]
    for i in range(len(pieces)):                       # no stop string is ever streamed, even across pieces
        assert not any(s in "".join(pieces[:i + 1]) for s in stop)
    assert choice.finish_reason == "stop"                   # stopped, or fewer tokens than max_tokens


def test_tokens_after_a_stop_string_are_dropped(tokenizer):
    ids = tokenizer("one two three four five", add_special_tokens=False)["input_ids"]
    choice = Choice(0, tokenizer, max_tokens=len(ids), stop=["three"])
    delta = choice.add(ids, [float(-i) for i in range(len(ids))])
    kept = len(tokenizer("one two three", add_special_tokens=False)["input_ids"])
    assert choice.stopped and choice.token_ids == ids[:kept] and delta.log_probs == [float(-i) for i in range(kept)]
    assert choice.finish_reason == "stop"


def test_finish_reasons(tokenizer):
    words = tokenizer("a b c d", add_special_tokens=False)["input_ids"]
    at_length = Choice(0, tokenizer, max_tokens=4, end_ids=frozenset({2}))
    at_length.add(words[:4], [])
    assert at_length.finish().finish_reason == "length"
    ended = Choice(0, tokenizer, max_tokens=4, end_ids=frozenset({2}))
    ended.add(words[:3] + [2], [])
    assert ended.finish().finish_reason == "stop" and ended.text == tokenizer.decode(words[:3])
    early = Choice(0, tokenizer, max_tokens=9, end_ids=frozenset({2}))
    early.add(words[:3], [])
    assert early.finish().finish_reason == "stop"       # fewer than max_tokens: the core ended it (end, guide)


def test_random_token_streams_match_the_reference(tokenizer):
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(3, 49152) for _ in range(40)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stop = [full[10:14]] if trial % 2 and len(full) > 20 else []
        cut = min([full.index(s) for s in stop if s in full], default=len(full))
        choice = Choice(0, tokenizer, max_tokens=40, stop=stop)
        assert "".join(stream(choice, ids, rng.randint(1, 5))) == full[:cut]
