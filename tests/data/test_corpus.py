"""The committed corpus format (orchestrator/data/corpus.py): bytes, checksums, the manifest, the repetition
filter. No model: a whitespace tokenizer stands in where a message has no token ids."""

from __future__ import annotations

import json
import subprocess

import pytest

from orchestrator.data import corpus
from orchestrator.data.conversations import Conversation
from orchestrator.errors import AerieError


class WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}


def _conv(i: int, answer_ids: list[int], answer: str = "an answer") -> Conversation:
    return Conversation(
        f"c/{i}",
        [
            {"role": "user", "content": f"question {i}", "token_ids": [1, 2]},
            {"role": "assistant", "content": answer, "token_ids": answer_ids},
        ],
        "synthetic:test",
    )


def test_a_chunk_round_trips_with_the_same_bytes_and_counts(tmp_path):
    convs = [_conv(i, list(range(10 + i))) for i in range(3)] + [_conv(3, [7, 8], "an answer")]
    path = tmp_path / f"synthetic-abc{corpus.SUFFIX}"
    corpus.save_chunk(path, convs, {"chunk": 0})
    first = path.read_bytes()
    corpus.save_chunk(path, convs, {"chunk": 0})
    assert path.read_bytes() == first  # no timestamp in the gzip header
    loaded, prov = corpus.load_chunk(path)
    assert [c.messages for c in loaded] == [c.messages for c in convs]
    assert prov["sha256"] == corpus.sha256_bytes(first)
    assert prov["counts"]["assistant_tokens"] == 10 + 11 + 12 + 2
    assert prov["counts"]["unique_assistant_tokens"] == 2  # one answer text four times: its last occurrence
    assert prov["counts"]["user_tokens_generated"] == 8


def test_a_corrupt_or_truncated_chunk_is_refused_by_name(tmp_path):
    path = tmp_path / f"regenerated-x{corpus.SUFFIX}"
    corpus.save_chunk(path, [_conv(0, [1, 2, 3])], {})
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(AerieError, match="git checkout"):
        corpus.load_chunk(path)
    assert corpus.load_chunk(tmp_path / f"missing{corpus.SUFFIX}") is None


def test_the_manifest_lists_every_chunk_with_totals(tmp_path):
    for k in range(3):
        corpus.save_chunk(tmp_path / f"synthetic-{k}{corpus.SUFFIX}", [_conv(k, [k] * 5, f"a{k}")], {"chunk": k})
    (tmp_path / f"synthetic-9{corpus.SUFFIX}").write_bytes(b"")  # a chunk without provenance is not listed
    manifest = corpus.write_manifest(tmp_path, {"model": "m", "target_sha256": "t"})
    assert manifest["totals"]["chunks"] == 3
    assert manifest["totals"]["assistant_tokens"] == 15
    assert [c["chunk"] for c in manifest["chunks"]] == [0, 1, 2]
    assert json.loads((tmp_path / corpus.MANIFEST).read_text()) == manifest


def test_a_looping_answer_is_trained_up_to_its_loop_and_an_early_loop_ends_the_conversation():
    natural = list(range(100, 300))
    loop = list(range(60)) + [5, 6, 7, 8, 9] * 40  # 60 good tokens, then a 5-token loop
    assert corpus.repetitive(loop) and not corpus.repetitive(natural)
    assert not corpus.repetitive([1] * 20)  # too short to judge
    assert corpus.loop_start(loop) == 65  # the second copy of the 5-token period
    assert corpus.loop_start(natural) == len(natural)
    convs = [
        Conversation(
            "masked",
            [
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "loop", "token_ids": loop},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "fine", "token_ids": natural},
                {"role": "user", "content": "q3"},
                {"role": "assistant", "content": "early loop", "token_ids": [5, 6, 7] * 30},
            ],
        ),
        _conv(1, [5, 6, 7] * 30),  # a loop from its first token: nothing to keep
        Conversation("human", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a b " * 40}]),
    ]
    kept, stats = corpus.drop_degenerate(convs, WordTokenizer())
    assert [c.id for c in kept] == ["masked"]
    messages = kept[0].messages
    assert [m["content"] for m in messages] == ["q1", "loop", "q2", "fine"]  # q3 went with its answer
    assert messages[1]["loss_tokens"] == 65 and "loss_tokens" not in messages[3]
    assert stats["masked_turns"] == 1 and stats["tokens_masked"] == len(loop) - 65
    assert stats["cut_turns"] == 3 and stats["conversations_dropped"] == 2
    assert stats["assistant_tokens_trained"] == 65 + len(natural)


def test_each_chunk_is_committed_alone(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("staged, not committed with the chunk")
    git("add", "other.txt")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "data" / f"synthetic-a{corpus.SUFFIX}"
    corpus.save_chunk(path, [_conv(0, [1])], {})
    assert corpus.git_commit([path, corpus.provenance_path(path)], "corpus: one chunk")
    assert git("show", "--name-only", "--format=%s", "HEAD").split() == [
        "corpus:",
        "one",
        "chunk",
        "data/synthetic-a.jsonl.gz",
        "data/synthetic-a.provenance.json",
    ]
    assert git("diff", "--cached", "--name-only").split() == ["other.txt"]
    monkeypatch.chdir("/")
    assert not corpus.git_commit([tmp_path / "nowhere" / "x"], "outside a repository")
