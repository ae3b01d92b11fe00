"""Chat-template rendering: the loss mask covers exactly the assistant turns, for every template variant."""

from __future__ import annotations

import pytest

from orchestrator.data.templates import LLAMA3_TEMPLATE, render_conversation

CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]


@pytest.mark.parametrize(
    ("template", "system", "end"),
    [(None, None, "<|im_end|>"), (None, "Be brief.", "<|im_end|>"), (LLAMA3_TEMPLATE, None, "<|eot_id|>")],
    ids=["chatml-default-system", "chatml-own-system", "llama3-headers"],
)
def test_loss_mask_is_the_assistant_turns(smollm2_tokenizer, template, system, end):
    messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    r = render_conversation(smollm2_tokenizer, messages, template)
    trained = smollm2_tokenizer.decode(r.input_ids[r.loss_mask])
    assert trained.startswith("Hello! How can I help?" + end)
    assert "Why did the chicken cross the road?" + end in trained
    context = smollm2_tokenizer.decode(r.input_ids[~r.loss_mask])
    assert "Hi there" in context and "Tell me a joke" in context
    assert "chicken" not in context and "How can I help" not in context
    if system:
        assert system in context


def test_truncation_keeps_the_mask_aligned(smollm2_tokenizer):
    full = render_conversation(smollm2_tokenizer, CHAT)
    cut = render_conversation(smollm2_tokenizer, CHAT, max_tokens=full.input_ids.numel() - 5)
    assert (cut.input_ids == full.input_ids[:-5]).all() and (cut.loss_mask == full.loss_mask[:-5]).all()
