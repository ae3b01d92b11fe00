"""The output text stream: what is held back, where a stop string cuts text and token ids."""

from __future__ import annotations

import random

import pytest

from orchestrator.runtime.detok import TextStream
from tests.runtime.fakes import CharTokenizer


def _ids(text: str) -> list[int]:
    return [ord(c) - 97 for c in text]


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    stream = TextStream(CharTokenizer(), ["end"])
    assert stream.add(_ids("hello e")) == "hello "  # "e" may start "end"
    assert stream.add(_ids("nd!")) == "" and stream.stopped
    assert stream.text == "hello "
    assert stream.ids == _ids("hello end")  # the token that completed the stop string is the last one
    plain = TextStream(CharTokenizer(), ["end"])
    assert plain.add(_ids("hi e")) == "hi " and plain.finish() == "e"


def test_without_a_tokenizer_it_only_collects_tokens():
    stream = TextStream()
    assert stream.add([1, 2]) == "" and stream.add([3]) == "" and stream.ids == [1, 2, 3]
    assert stream.finish() == "" and not stream.stopped


TEXTS = [
    "Hello there! How are you today?\n\nI'm fine, thanks.",
    "Ünïcödé: naïve café, 中文字符, 日本語のテキスト, emoji 🙂🚀 and 🧑‍🚀.",
    "def f(x):\n    return x ** 2  # tabs\tand   spaces",
]


class _Counting:
    """A tokenizer that counts the token ids it decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream_all(tokenizer, ids, stop=(), chunk=1):
    stream = TextStream(tokenizer, stop)
    deltas = [stream.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return stream, "".join(deltas) + stream.finish()


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_incremental_text_equals_a_full_decode(smollm2_tokenizer, chunk):
    rng = random.Random(chunk)
    special = smollm2_tokenizer.all_special_ids
    for text in TEXTS:
        ids = smollm2_tokenizer(text)["input_ids"]
        assert _stream_all(smollm2_tokenizer, ids, chunk=chunk)[1] == text
        noisy = [t for i in ids for t in ([i] if rng.random() < 0.8 else [i, rng.choice(special)])]
        assert _stream_all(smollm2_tokenizer, noisy, chunk=chunk)[1] == text  # special tokens are skipped
    for _ in range(50):  # any ids: the same text as one decode, broken characters included
        ids = [rng.randrange(len(smollm2_tokenizer)) for _ in range(rng.randrange(1, 40))]
        assert _stream_all(smollm2_tokenizer, ids, chunk=chunk)[1] == smollm2_tokenizer.decode(
            ids, skip_special_tokens=True
        )


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_strings_cut_where_a_full_decode_would(smollm2_tokenizer, chunk):
    rng = random.Random(chunk)
    for text in TEXTS:
        ids = smollm2_tokenizer(text)["input_ids"]
        for _ in range(20):
            a = rng.randrange(len(text) - 1)
            stops = [text[a : a + rng.randint(1, 6)], "never appears"]
            stream, released = _stream_all(smollm2_tokenizer, ids, stops, chunk)
            first = min(i for i in (text.find(s) for s in stops) if i >= 0)
            assert stream.stopped and released == text[:first] == stream.text
            n = next(n for n in range(1, len(ids) + 1) if any(s in smollm2_tokenizer.decode(ids[:n]) for s in stops))
            assert stream.ids == ids[:n]  # up to the token that completed the stop string


def test_the_work_per_token_does_not_grow_with_the_output(smollm2_tokenizer):
    """Per token: a fixed number of token ids decoded and of characters searched for stop strings."""
    ids = smollm2_tokenizer(" ".join(TEXTS) * 200)["input_ids"]
    per_token = {}
    for n in (100, 4000):
        counting = _Counting(smollm2_tokenizer)
        stream = TextStream(counting, ["\n\n\n\n", "THE END", "x" * 64])
        for t in ids[:n]:
            stream.add([t])
            assert len(stream.pending) <= 63
        per_token[n] = counting.decoded / n
    assert per_token[4000] <= 1.1 * per_token[100], per_token
