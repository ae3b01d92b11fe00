"""Dataset loading: formats, malformed records counted with line numbers, splits stable by id."""

from __future__ import annotations

import json

from orchestrator.data.conversations import LoadReport, load_chitchat, load_messages_jsonl, load_sharegpt, split_of


def test_jsonl_counts_and_skips_bad_lines(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    no_answer = {"messages": [{"role": "user", "content": "a"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join([json.dumps(good), "{broken", json.dumps(no_answer), '{"messages": 3}', json.dumps(good)])
    )
    report = LoadReport()
    convs = load_messages_jsonl(path, report)
    assert len(convs) == 2 and report.loaded == 2
    assert report.malformed == 2 and report.malformed_lines == ["d.jsonl:2", "d.jsonl:4"]
    assert report.no_assistant == 1


def test_sharegpt_maps_roles(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            [
                {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                {"id": "y", "conversations": [{"from": "alien", "value": "q"}]},
            ]
        )
    )
    report = LoadReport()
    (conv,) = load_sharegpt(path, report)
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert report.malformed_lines == ["s.json[1]"]


def test_chitchat_alternates_speakers():
    report = LoadReport()
    convs = load_chitchat(report)
    assert len(convs) == report.loaded > 4000
    assert report.loaded + report.no_assistant + report.malformed == 7168  # single-turn chats have no answer
    roles = [m["role"] for m in convs[0].messages]
    assert roles[:2] == ["user", "assistant"] and all(a != b for a, b in zip(roles, roles[1:], strict=False))


def test_split_is_a_pure_function_of_the_id():
    ids = [f"conv-{i}" for i in range(2000)]
    splits = [split_of(i, 0.1) for i in ids]
    assert splits == [split_of(i, 0.1) for i in ids]
    assert 140 < splits.count("validation") < 260
