"""Synthetic prompts and regeneration logic with a scripted decoder (no model, no Ray): echoes of the steering
prompt and repeats across chunks are dropped, chunk ids continue, chunk statistics add up, turns are cut, and
regeneration shows one bar over every turn's answers."""

from __future__ import annotations

import io
import itertools

from tqdm import tqdm

from orchestrator.data import synthetic
from orchestrator.data.collect import sum_stats
from orchestrator.data.conversations import Conversation, first_turns
from orchestrator.data.synthetic import RegenerateConfig, SyntheticConfig, answer_turns, is_echo, synthesise_prompts
from orchestrator.engine.engine import Generation


class ScriptedDecoder:
    """Completes every prompt with the next scripted text (finished with EOS), recording the topic it saw and
    the size of each batch; advances the caller's bar per prompt, as the engines do."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.prompts, self.batches = tokenizer, itertools.cycle(texts), [], []

    def generate(self, prompts, params, progress=None):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            out.append(Generation(list(p), self.tokenizer(next(self.texts))["input_ids"], "stop"))
            if progress is not None:
                progress.update()
        return out


def test_echoes_of_the_steering_prompt_are_recognised():
    assert is_echo("The user asks about math.", "math")
    assert is_echo("user asks about coding: how do I sort a list?", "coding")
    assert is_echo("About math: what is 2+2?", "math")
    assert not is_echo("What is the derivative of x^2?", "math")
    assert not is_echo("Tell me about the history of Rome.", "history and the humanities")


def test_prompts_drop_echoes_and_repeats_across_chunks(smollm2_tokenizer):
    cfg = SyntheticConfig(num_conversations=4, topics=["math", "coding", "art"])
    texts = ["The user asks about math.", "What is a prime number?", "How do I reverse a list in Python?", "Hi"]
    seen: set[str] = set()
    first, stats = synthesise_prompts(ScriptedDecoder(smollm2_tokenizer, texts), smollm2_tokenizer, cfg, 2, 0, seen)
    assert [c.messages[0]["content"] for c in first] == [texts[1], texts[2]]
    assert [c.id for c in first] == ["synthetic/0/0", "synthetic/0/1"]
    assert stats["echoes"] == 1 and stats["too_short"] == 1 and stats["kept"] == 2

    more = texts + ["What is a prime number ?", "Write a haiku about rain.", "Explain recursion simply."]
    decoder = ScriptedDecoder(smollm2_tokenizer, more)
    second, stats = synthesise_prompts(decoder, smollm2_tokenizer, cfg, 2, 2, seen)
    assert [c.id for c in second] == ["synthetic/0/2", "synthetic/0/3"]
    kept = {c.messages[0]["content"] for c in first + second}
    assert len(kept) == 4 and stats["duplicates"] >= 2  # chunk 1's repeats of chunk 0 (case, spacing) dropped
    assert "The user asks about art." in decoder.prompts[0]  # topics go on from the chunk's first id


def test_chunk_statistics_add_up():
    parts = [
        {"generated": 10, "kept": 4, "seconds": 1.25, "per_topic": {"math": 2, "coding": 2}},
        {"generated": 6, "kept": 4, "seconds": 2.5, "per_topic": {"math": 3, "art": 1}},
    ]
    assert sum_stats(parts) == {
        "generated": 16,
        "kept": 8,
        "seconds": 3.8,
        "per_topic": {"math": 5, "coding": 2, "art": 1},
    }


def test_first_turns_keeps_whole_exchanges():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    conv = Conversation("c", messages, "chitchat")
    assert first_turns(conv, 1).messages == messages[:3]
    assert first_turns(conv, 2).messages == messages[:5]
    assert first_turns(conv, 5).messages == messages and first_turns(conv, 1).id == "c"


def test_regeneration_shows_one_bar_over_every_turn(smollm2_tokenizer, monkeypatch):
    """Conversations of 3, 1 and 5 user turns, the third full at its third turn: 3 + 2 + 1 answers, one bar that
    ends at 6/6, and no call to the decoder for the turns nobody reaches (vLLM drew an empty bar for each)."""
    bars: list[tqdm] = []

    def recorded(**kwargs) -> tqdm:
        bars.append(tqdm(file=io.StringIO(), **kwargs))
        return bars[-1]

    monkeypatch.setattr(synthetic, "bar", recorded)

    def conv(name: str, users: list[str]) -> Conversation:
        messages = [m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "a"})]
        return Conversation(name, messages, "chitchat")

    long = "tell me more " * 80  # ~240 tokens: past the budget after two turns
    conversations = [conv("a", ["hi", "and?", "so?"]), conv("b", ["hello"]), conv("c", ["yo", "ok", long, "x", "y"])]
    decoder = ScriptedDecoder(smollm2_tokenizer, ["Sure."])
    cfg = RegenerateConfig(max_new_tokens=16)
    answered = answer_turns(decoder, smollm2_tokenizer, conversations, cfg, max_length_tokens=256)
    assert [sum(m["role"] == "assistant" for m in c.messages) for c in answered] == [3, 1, 2]
    assert decoder.batches == [3, 2, 1]
    assert len(bars) == 1 and bars[0].desc == "answers" and bars[0].n == bars[0].total == 6
    assert "tok/s" in str(bars[0].postfix)
