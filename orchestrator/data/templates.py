"""Render conversations with a chat template and mark the assistant tokens (the loss mask).

The mask comes from the rendered text, so it is right for any Jinja template: assistant turn i spans the
characters between the rendering of `messages[:i]` with the generation prompt and the rendering of
`messages[:i+1]`; tokens that start in such a span are trained on (a BPE token may straddle its end).

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n | Hello!<|im_end|>\\n |
    mask:              0 ...                                  1 1 1 ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrator.errors import AerieError

LLAMA3_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass
class Rendered:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: assistant tokens
    template: str  # the variant's name


def _render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def _loss_end(tokenizer, full: str, start: int, message: dict) -> int:
    """Where the text of a message's first `loss_tokens` generated tokens ends in the rendered conversation."""
    prefix = tokenizer.decode(message["token_ids"][: message["loss_tokens"]], skip_special_tokens=True).lstrip()
    content = message["content"]
    same = next(
        (k for k, (a, b) in enumerate(zip(prefix, content, strict=False)) if a != b), min(len(prefix), len(content))
    )
    at = full.find(content[:same], start) if same else start
    return (at if at >= 0 else start) + same


def render_conversation(
    tokenizer, messages: list[dict], template: str | None = None, name: str = "default", max_tokens: int | None = None
) -> Rendered:
    """Token ids and assistant mask of a conversation; truncated to `max_tokens` (mask cut with it)."""
    full = _render(tokenizer, messages, template, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], template, True))
        end = len(_render(tokenizer, messages[: i + 1], template, False))
        if not full.startswith(_render(tokenizer, messages[: i + 1], template, False)):
            raise AerieError(f"chat template {name!r} does not render conversations prefix by prefix")
        if "loss_tokens" in m:  # trained only up to there (data/corpus.py: where a loop starts repeating)
            end = min(end, _loss_end(tokenizer, full, start, m))
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        mask[t] = b > a and any(s <= a < e for s, e in spans)  # a token belongs where it starts
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return Rendered(ids, mask, name)
