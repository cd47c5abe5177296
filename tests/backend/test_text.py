"""Text shared by the text models and the client: incremental detokenization, embedding bias from words."""
import numpy as np
import pytest

from backend.text import IncrementalDetokenizer, embedding_bias, load_tokenizer, words_list

TEXT = "naïve café, 你好, emoji 😀🎉 and ∑ done"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def test_characters_spanning_several_byte_level_tokens_arrive_whole(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT.split())                          # the emoji and CJK take several tokens each
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([token_id]) for token_id in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == detok.emitted
    assert all("\ufffd" not in piece for piece in pieces) and "" in pieces   # waits inside a character
    assert any("😀" in piece for piece in pieces)


def test_special_tokens_are_skipped_and_chunks_of_tokens_work(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_words_list_and_embedding_bias_follow_the_tokenizer(tokenizer):
    words = [" banana", " hello world"]
    listed = words_list(tokenizer, words)
    ids = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    assert listed[0, :len(ids[0]) + len(ids[1])].tolist() == ids[0] + ids[1]
    assert listed[1, :2].tolist() == [len(ids[0]), len(ids[0]) + len(ids[1])]
    bias = embedding_bias(tokenizer, words, [2.0, -1.0], 49152)
    expected = np.zeros(49152, np.float32)
    for word_ids, weight in zip(ids, [2.0, -1.0]):
        for token_id in word_ids:
            expected[token_id] += weight
    assert np.array_equal(bias, expected)
    with pytest.raises(ValueError, match="must have the same length"):
        embedding_bias(tokenizer, words, [1.0], 49152)
