"""The output text stream: what is held back, where a stop string cuts text and token ids."""

from __future__ import annotations

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
