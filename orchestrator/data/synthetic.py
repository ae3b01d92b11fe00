"""Training data written by the target itself.

Magpie-style prompt synthesis: render the chat template up to the start of a user turn (after a
topic-steering system prompt) and let the target write the user's message:

    <|im_start|>system\\nThe user asks about math.<|im_end|>\\n<|im_start|>user\\n  ->  "What is the derivative..."

Sampled (T=1.0, top-p 0.95 by default), then filtered (empty, too short, truncated, echoes of the steering
prompt such as "The user asks about math") and de-duplicated.
Follow-up user turns are written the same way after the answer. Regeneration (self-distillation) replaces
every assistant turn by the target's own answer, turn by turn, so the drafter learns the distribution it
will be served against; one bar counts the answers over every turn. Every generated message keeps the token
ids the target emitted. Results are saved in chunks (orchestrator/data/corpus.py) and reused when the settings
match.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from typing import Literal

from pydantic import Field
from tqdm import tqdm

from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.data.conversations import Conversation
from orchestrator.engine import SpecEngine
from orchestrator.engine.vllm_backend import VllmGenerator
from orchestrator.spec.sampling import SamplingParams

log = logging.getLogger(__name__)
MARK = "\x00AERIE_USER_TURN\x00"
TOPICS = (
    "coding",
    "math",
    "reasoning",
    "writing",
    "roleplay",
    "information extraction",
    "science and engineering",
    "history and the humanities",
    "everyday questions",
)


class SyntheticConfig(StrictModel):
    num_conversations: int = Field(ge=1, description="conversations to keep (more are sampled to allow for filtering)")
    topics: list[str] = Field(
        default_factory=lambda: list(TOPICS),
        min_length=1,
        description="subjects the system prompt steers the target's prompts to, taken in turn",
    )
    user_turns: int = Field(1, ge=1, le=4, description="user turns per conversation (follow-ups after answers)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the user turns the target writes")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling of the user turns: share of probability kept")
    max_prompt_tokens: int = Field(96, ge=8, description="a prompt still unfinished here is dropped as truncated")
    min_prompt_chars: int = Field(12, ge=1, description="a user turn shorter than this (characters) is dropped")
    seed: int = Field(0, description="seed of the user turns' sampling (also in the conversations' ids)")


class RegenerateConfig(StrictModel):
    max_new_tokens: int = Field(256, ge=1, description="per assistant turn")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    cache_dir: str = Field("runs/datasets", description="where regenerated datasets are kept for reuse")
    generator: Literal["target", "vllm"] = Field(
        "target", description="target: the project's engine; vllm: vLLM's batched engine (faster at large batches)"
    )
    vllm_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="vLLM generator precision (the training targets come from the fp32 capture anyway)"
    )
    chunk_conversations: int = Field(
        1000, ge=1, description="conversations generated and saved at a time: a stopped run resumes at its last chunk"
    )
    commit: bool = Field(
        False, description="commit each chunk to git as it is written (a corpus kept in the repository, e.g. data/)"
    )

    def cache_settings(self) -> dict:
        """What decides the generated text (not where it is kept, how it is split into files, or committed)."""
        return self.model_dump(exclude={"chunk_conversations", "cache_dir", "commit"})


def user_turn_prefix(tokenizer, messages: list[dict]) -> str:
    """The template rendered up to where the next user message's text begins (any template)."""
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": MARK}], tokenize=False)
    return text[: text.index(MARK)]


def _complete(
    decoder: SpecEngine | VllmGenerator,
    tokenizer,
    texts: list[str],
    params: list[SamplingParams],
    progress: tqdm | None = None,
) -> list[tuple[str, bool, list[int]]]:
    """Continue each rendered text; returns (completion, finished with EOS, its token ids without special tokens)
    per text, advancing `progress` by one as each finishes. No text: no call to the decoder."""
    if not texts:
        return []
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    special = set(tokenizer.all_special_ids)
    out = []
    for g in decoder.generate(prompts, params, progress=progress):
        ids = [t for t in g.token_ids if t not in special]
        out.append((tokenizer.decode(ids, skip_special_tokens=True).strip(), g.finish_reason == "stop", ids))
    return out


def normalise(text: str) -> str:
    """The form prompts are de-duplicated in: lower case, runs of non-word characters as one space."""
    return re.sub(r"\W+", " ", text.lower()).strip()


def steering_prompt(topic: str) -> str:
    return f"The user asks about {topic}."


def is_echo(text: str, topic: str) -> bool:
    """The target repeated its steering prompt instead of writing a user message ("The user asks about math",
    "User asks about coding: ...")."""
    said = normalise(text)
    return "user asks about" in said or said.startswith(normalise(f"about {topic}"))


def synthesise_prompts(
    decoder: SpecEngine | VllmGenerator,
    tokenizer,
    cfg: SyntheticConfig,
    wanted: int | None = None,
    first_id: int = 0,
    seen: set[str] | None = None,
) -> tuple[list[Conversation], dict]:
    """Magpie-style first user turns, balanced over topics; returns conversations and statistics.
    A chunked source calls this once per chunk: `wanted` prompts with ids (and seeds) from `first_id`, `seen`
    holding the normalised prompts of the chunks before (so no chunk repeats another's; updated here)."""
    wanted = cfg.num_conversations if wanted is None else wanted
    kept: list[Conversation] = []
    seen = set() if seen is None else seen
    stats = Counter()
    per_topic = Counter()
    round_ = 0
    with bar(total=0, desc="synthetic prompts", unit="prompt") as written:  # each round adds its batch
        while len(kept) < wanted and round_ < 5:
            batch = [cfg.topics[(first_id + i) % len(cfg.topics)] for i in range(2 * (wanted - len(kept)))]
            texts = [user_turn_prefix(tokenizer, [{"role": "system", "content": steering_prompt(t)}]) for t in batch]
            params = [
                SamplingParams(
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    max_tokens=cfg.max_prompt_tokens,
                    seed=int(hashlib.sha256(f"{cfg.seed}/{first_id}/{round_}/{i}".encode()).hexdigest()[:8], 16),
                )
                for i in range(len(batch))
            ]
            written.total += len(batch)
            for topic, (text, finished, ids) in zip(
                batch, _complete(decoder, tokenizer, texts, params, written), strict=True
            ):
                stats["generated"] += 1
                key = normalise(text)
                if not finished:
                    stats["truncated"] += 1
                elif len(text) < cfg.min_prompt_chars:
                    stats["too_short"] += 1
                elif is_echo(text, topic):
                    stats["echo"] += 1
                elif key in seen:
                    stats["duplicate"] += 1
                elif len(kept) < wanted:
                    seen.add(key)
                    per_topic[topic] += 1
                    kept.append(
                        Conversation(
                            f"synthetic/{cfg.seed}/{first_id + len(kept)}",
                            [{"role": "user", "content": text, "token_ids": ids}],
                            f"synthetic:{topic}",
                        )
                    )
            round_ += 1
            written.set_postfix_str(f"kept {len(kept)}/{wanted}")
    return kept, {
        "generated": stats["generated"],
        "kept": len(kept),
        "truncated": stats["truncated"],
        "too_short": stats["too_short"],
        "echoes": stats["echo"],
        "duplicates": stats["duplicate"],
        "per_topic": dict(per_topic),
    }


def answer_turns(
    decoder: SpecEngine | VllmGenerator,
    tokenizer,
    conversations: list[Conversation],
    cfg: RegenerateConfig,
    follow_up: SyntheticConfig | None = None,
    max_length_tokens: int = 2048,
) -> list[Conversation]:
    """Replace (or add) every assistant turn with the target's own answer, turn by turn, all conversations
    batched; with `follow_up`, append target-written user follow-ups until it has `user_turns` turns. A
    conversation stops once it is `max_length_tokens` long (capture would truncate the rest anyway).

    One bar counts the answers over every turn. Its total is the most answers still possible (a conversation
    without an answer in one turn gets none later), so it shrinks to the exact count as turns end: user turns
    [3, 1] start at 4; when the first conversation is full at turn 2, the bar ends at 2/2."""
    users = [[m for m in c.messages if m["role"] == "user"] for c in conversations]
    systems = [[m for m in c.messages if m["role"] == "system"] for c in conversations]
    turns = max(len(u) for u in users) if follow_up is None else follow_up.user_turns
    history = [list(s) for s in systems]
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=0)
    most = sum(len(u) for u in users) if follow_up is None else len(users) * turns
    generated_tokens = 0
    with bar(total=most, desc="answers", unit="answer") as answers:
        for turn in range(turns):
            if follow_up is not None and turn > 0:
                _write_follow_ups(decoder, tokenizer, follow_up, history, users, turn)
            active = [i for i in range(len(history)) if turn < len(users[i])]
            for i in active:
                history[i].append(users[i][turn])
            texts = [
                tokenizer.apply_chat_template(history[i], tokenize=False, add_generation_prompt=True) for i in active
            ]
            budget = max_length_tokens - cfg.max_new_tokens
            fits = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= budget for t in texts]
            for i, ok in zip(active, fits, strict=True):
                if not ok:  # full: drop this user turn and stop the conversation here
                    history[i].pop()
                    del users[i][turn:]
            active = [i for i, ok in zip(active, fits, strict=True) if ok]
            texts = [t for t, ok in zip(texts, fits, strict=True) if ok]
            if not active:  # no conversation goes on
                break
            later = len(active) * (turns - turn - 1) if follow_up else sum(len(users[i]) - turn - 1 for i in active)
            answers.total = answers.n + len(active) + later
            answers.set_postfix_str(f"turn {turn + 1}/{turns}", refresh=False)
            for i, (text, _, ids) in zip(
                active, _complete(decoder, tokenizer, texts, [params] * len(active), answers), strict=True
            ):
                history[i].append({"role": "assistant", "content": text, "token_ids": ids})
                generated_tokens += len(ids)
            tokens_per_s = generated_tokens / max(answers.format_dict["elapsed"], 1e-9)
            answers.set_postfix_str(f"turn {turn + 1}/{turns}, {tokens_per_s:.0f} tok/s")
        answers.total = answers.n  # the conversations that stopped early
    return [Conversation(c.id, h, c.source) for c, h in zip(conversations, history, strict=True)]


def _write_follow_ups(decoder, tokenizer, follow_up: SyntheticConfig, history, users, turn: int) -> None:
    """A target-written user turn `turn` for each conversation that has none yet (appended to `users`)."""
    need = [i for i in range(len(history)) if len(users[i]) <= turn]
    texts = [user_turn_prefix(tokenizer, history[i]) for i in need]
    p = [
        SamplingParams(
            temperature=follow_up.temperature,
            top_p=follow_up.top_p,
            max_tokens=follow_up.max_prompt_tokens,
            seed=follow_up.seed + 7919 * i + turn,
        )
        for i in need
    ]
    for i, (text, finished, ids) in zip(need, _complete(decoder, tokenizer, texts, p), strict=True):
        if finished and len(text) >= follow_up.min_prompt_chars:
            users[i].append({"role": "user", "content": text, "token_ids": ids})
