"""Evaluation prompt sets, as token ids with a label each.

mtbench      both turns (second turns after the target's own greedy first answer)
validation   the collection's held-out conversations, cut where the first assistant answer begins
long_context MT-Bench first turns after earlier chitchat conversations, filled up to a context bucket:
             [user, assistant, user, ... (earlier talk, ~bucket tokens)] + [user: question]
templates    MT-Bench first turns under system prompts and chat templates not used in training
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.data.conversations import LoadReport, load_chitchat
from orchestrator.data.prompts import mtbench_questions, render_chat
from orchestrator.data.reader import ShardReader, shard_order
from orchestrator.data.templates import LLAMA3_TEMPLATE

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].capitalize() + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Variants unlike the training data (which used the default system prompt and three others under ChatML).
TEMPLATE_VARIANTS: dict[str, tuple[str | None, str | None]] = {
    "chatml-default": (None, None),
    "chatml-pirate": ("You are a pirate. Answer every question in pirate speak.", None),
    "chatml-reviewer": ("You are a meticulous senior engineer. Be precise and critical.", None),
    "chatml-empty-system": ("", None),
    "llama3-template": (None, LLAMA3_TEMPLATE),
    "plain-template": (None, PLAIN_TEMPLATE),
}


@dataclass
class EvalPrompt:
    set: str
    label: str  # bucket / template variant / turn
    ids: list[int]
    category: str = ""  # MT-Bench's category (writing, ..., humanities); "" elsewhere


def mtbench_prompt_ids(
    model_dir: Path, tokenizer, eos: Sequence[int], num_questions: int, answer_tokens: int, system: str | None = None
) -> list[list[int]]:
    """Every first turn of the first `num_questions` MT-Bench questions, then every second turn after the
    target's own greedy first answer (at most `answer_tokens`), optionally after a system message."""
    from orchestrator.data.prompts import PromptItem, encode_prompt
    from orchestrator.engine import load_engine
    from orchestrator.spec.sampling import SamplingParams

    questions = mtbench_questions()[:num_questions]
    head = [{"role": "system", "content": system}] if system is not None else []
    firsts = [head + [{"role": "user", "content": q["turns"][0]}] for q in questions]
    first_ids = [encode_prompt(tokenizer, PromptItem(0, messages=m)) for m in firsts]
    engine = load_engine(model_dir, max_batch=16, eos_token_ids=eos)
    answers = engine.generate(first_ids, SamplingParams(max_tokens=answer_tokens))
    seconds = [
        m
        + [
            {"role": "assistant", "content": tokenizer.decode(a.token_ids, skip_special_tokens=True)},
            {"role": "user", "content": q["turns"][1]},
        ]
        for m, a, q in zip(firsts, answers, questions, strict=True)
    ]
    return first_ids + [encode_prompt(tokenizer, PromptItem(0, messages=m)) for m in seconds]


def mtbench_set(model_dir: Path, tokenizer, eos: Sequence[int], num_questions: int, answer_tokens: int) -> list:
    ids = mtbench_prompt_ids(model_dir, tokenizer, eos, num_questions, answer_tokens)
    categories = [q["category"] for q in mtbench_questions()[:num_questions]] * 2  # first turns, then second
    half = len(ids) // 2
    return [
        EvalPrompt("mtbench", "turn 1" if i < half else "turn 2", p, c)
        for i, (p, c) in enumerate(zip(ids, categories, strict=True))
    ]


def held_out_sequences(data: str) -> Iterator:
    """The validation split's sequences (token ids and loss mask) in the order a reader takes them: from a finished
    collection, or, where `data` is a collection config (`*.yaml`; online training keeps no collection), rendered
    from that config's conversations exactly as its collection would write them, with nothing captured."""
    from orchestrator.data.collect import is_collect_config, planned_collection

    if not is_collect_config(data):
        return iter(ShardReader(data, "validation", buffer_sequences=1))
    plans, _ = shard_order([p for p in planned_collection(data)["plans"] if p.split == "validation"], 0)
    return (seq for plan in plans for seq in plan.sequences)


def validation_set(data: str, num_prompts: int) -> list[EvalPrompt]:
    """Held-out conversations up to their first assistant token (as collected: template and system prompt)."""
    out = []
    for seq in held_out_sequences(data):
        first = seq.loss_mask.nonzero()
        if len(first) and int(first[0]) > 0:
            out.append(EvalPrompt("validation", "held-out", seq.input_ids[: int(first[0])].tolist()))
        if len(out) >= num_prompts:
            break
    return out


def long_context_set(tokenizer, buckets: Sequence[int], per_bucket: int, window: int) -> list[EvalPrompt]:
    """Per bucket, `per_bucket` questions after earlier conversations filling the context up to the bucket."""
    chats = load_chitchat(LoadReport())
    questions = mtbench_questions()
    out, source = [], 0
    for bucket in buckets:
        if bucket >= window:
            continue
        for q in range(per_bucket):
            question = [{"role": "user", "content": questions[(q * 7 + bucket) % len(questions)]["turns"][0]}]
            history: list[dict] = []
            while True:
                turns = [m for m in chats[source % len(chats)].messages if m["role"] in ("user", "assistant")]
                source += 1
                grown = history
                for m in turns:
                    candidate = grown + [m]
                    if len(render_chat(tokenizer, _alternating(candidate) + question)) > bucket:
                        break
                    grown = candidate
                if grown == history:
                    break
                history = grown
            out.append(
                EvalPrompt("long_context", f"<={bucket}", render_chat(tokenizer, _alternating(history) + question))
            )
    return out


def _alternating(messages: list[dict]) -> list[dict]:
    """Drop turns so roles alternate and the history ends with the assistant (the question follows)."""
    out: list[dict] = []
    for m in messages:
        if (not out and m["role"] == "user") or (out and m["role"] != out[-1]["role"]):
            out.append(m)
    if out and out[-1]["role"] == "user":
        out.pop()
    return out


def template_set(tokenizer, num_prompts: int) -> list[EvalPrompt]:
    out = []
    for name, (system, template) in TEMPLATE_VARIANTS.items():
        for q in mtbench_questions()[:num_prompts]:
            messages = [{"role": "system", "content": system}] if system is not None else []
            messages.append({"role": "user", "content": q["turns"][0]})
            out.append(EvalPrompt("templates", name, render_chat(tokenizer, messages, template)))
    return out
