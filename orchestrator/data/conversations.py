"""Conversation datasets: OpenAI-style `{"messages": [...]}` JSONL, ShareGPT JSON, and built-in sources.

    Conversation(id="chitchat/a07e...", messages=[{"role": "user", ...}, {"role": "assistant", ...}, ...])

Malformed records never stop a load: they are counted in `LoadReport` with their line numbers and skipped,
and so are conversations without an assistant turn (nothing to train on).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.data.prompts import ROLES, mtbench_questions
from orchestrator.errors import AerieError
from orchestrator.models.prepare import PackagedModel, packaged_file

CHITCHAT = PackagedModel("chitchat_dataset", "dataset.json")  # PyPI chitchat-dataset (MIT)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Conversation:
    id: str
    messages: list[dict]
    source: str = ""


def first_turns(conv: Conversation, user_turns: int) -> Conversation:
    """The conversation up to (not including) its user turn number `user_turns + 1`."""
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
    end = users[user_turns] if len(users) > user_turns else len(conv.messages)
    return Conversation(conv.id, conv.messages[:end], conv.source)


@dataclass
class LoadReport:
    """What a load kept and skipped, with line numbers of malformed records (first 20 kept)."""

    loaded: int = 0
    malformed: int = 0
    no_assistant: int = 0
    malformed_lines: list[str] = field(default_factory=list)

    def bad(self, where: str) -> None:
        self.malformed += 1
        if len(self.malformed_lines) < 20:
            self.malformed_lines.append(where)

    def merge(self, other: LoadReport) -> None:
        self.loaded += other.loaded
        self.malformed += other.malformed
        self.no_assistant += other.no_assistant
        self.malformed_lines += other.malformed_lines[: 20 - len(self.malformed_lines)]


def _valid_messages(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    )


def _keep(conv: Conversation, report: LoadReport, out: list[Conversation]) -> None:
    if not any(m["role"] == "assistant" for m in conv.messages):
        report.no_assistant += 1
        return
    report.loaded += 1
    out.append(conv)


def load_messages_jsonl(path: str | Path, report: LoadReport) -> list[Conversation]:
    """`{"messages": [...], "id"?: ...}` per line."""
    path = Path(path)
    if not path.is_file():
        raise AerieError(f"dataset file {str(path)!r} does not exist")
    out: list[Conversation] = []
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                report.bad(f"{path.name}:{line_no}")
                continue
            messages = record.get("messages") if isinstance(record, dict) else None
            if not _valid_messages(messages):
                report.bad(f"{path.name}:{line_no}")
                continue
            conv_id = str(record.get("id", f"{path.stem}/{line_no}"))
            _keep(Conversation(conv_id, messages, path.name), report, out)
    return out


def load_sharegpt(path: str | Path, report: LoadReport) -> list[Conversation]:
    """ShareGPT JSON: a list of `{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`."""
    path = Path(path)
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise AerieError(f"dataset file {str(path)!r} does not exist") from err
    except json.JSONDecodeError as err:
        raise AerieError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(records, list):
        raise AerieError(f"{path}: expected a JSON list of ShareGPT records")
    out: list[Conversation] = []
    for index, record in enumerate(records):
        turns = record.get("conversations") if isinstance(record, dict) else None
        try:
            messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        except (KeyError, TypeError):
            report.bad(f"{path.name}[{index}]")
            continue
        if not _valid_messages(messages):
            report.bad(f"{path.name}[{index}]")
            continue
        _keep(Conversation(str(record.get("id", f"{path.stem}/{index}")), messages, path.name), report, out)
    return out


def load_chitchat(report: LoadReport) -> list[Conversation]:
    """The chitchat dataset: each inner list is one speaker's turn; the first speaker is the user."""
    data = json.loads(packaged_file(CHITCHAT).read_text())
    out: list[Conversation] = []
    for conv_id, record in data.items():
        messages = []
        for i, turn in enumerate(record.get("messages", [])):
            text = " ".join(m.get("text", "").strip() for m in turn).strip()
            if text:
                messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        if messages:
            _keep(Conversation(f"chitchat/{conv_id}", messages, "chitchat"), report, out)
        else:
            report.bad(f"chitchat/{conv_id}")
    return out


def load_mtbench_first_turns() -> list[Conversation]:
    """MT-Bench first turns as user-only conversations (evaluation, or regeneration input)."""
    return [
        Conversation(f"mtbench/{q['question_id']}", [{"role": "user", "content": q["turns"][0]}], "mtbench")
        for q in mtbench_questions()
    ]


def split_of(conv_id: str, validation_fraction: float) -> str:
    """'train' or 'validation', decided by a hash of the id alone (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.sha256(conv_id.encode()).digest()[:8], "big") / 2**64
    return "validation" if bucket < validation_fraction else "train"
