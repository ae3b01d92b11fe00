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


def test_system_prompts_are_drawn_per_conversation(smollm2_tokenizer):
    from orchestrator.data.collect import CollectConfig, render_all
    from orchestrator.data.conversations import Conversation

    cfg = CollectConfig(
        model="unused",
        output="unused",
        sources=[{"kind": "chitchat"}],
        templates=[{"name": "plain"}, {"name": "sys", "system_prompts": ["AAA rule.", "BBB rule."]}],
    )
    convs = [Conversation(f"c{i}", CHAT) for i in range(16)]
    rendered = render_all(cfg, convs, smollm2_tokenizer)
    seqs = rendered["train"] + rendered["validation"]
    texts = {(s.conversation_id, s.template): smollm2_tokenizer.decode(s.input_ids) for s in seqs}
    assert len(texts) == 32
    picked = ["AAA" if "AAA rule." in t else "BBB" for (c, v), t in texts.items() if v == "sys"]
    assert set(picked) == {"AAA", "BBB"}
    assert not any("rule." in t for (c, v), t in texts.items() if v == "plain")
    again = render_all(cfg, convs, smollm2_tokenizer)
    assert [s.input_ids.tolist() for s in again["train"]] == [s.input_ids.tolist() for s in rendered["train"]]


@pytest.mark.parametrize("template", [None, LLAMA3_TEMPLATE], ids=["chatml", "llama3-headers"])
def test_a_looping_answer_is_trained_only_up_to_its_loop(smollm2_tokenizer, template):
    """data/corpus.py marks a looping answer with loss_tokens: its first tokens are trained on, the loop and its
    end token are context only; later turns are trained on as usual."""
    tok = smollm2_tokenizer
    answer = "Paris is the capital. It is large. It is large. It is large. It is large."
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    keep = len(tok("Paris is the capital. It is large.", add_special_tokens=False)["input_ids"])
    messages = [
        {"role": "user", "content": "Tell me about Paris"},
        {"role": "assistant", "content": answer, "token_ids": ids, "loss_tokens": keep},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": "Rome is old."},
    ]
    r = render_conversation(tok, messages, template)
    trained = tok.decode(r.input_ids[r.loss_mask])
    assert trained.startswith("Paris is the capital. It is large.")
    assert trained.count("It is large") == 1 and "Rome is old." in trained
    plain = render_conversation(tok, [{k: v for k, v in m.items() if k != "loss_tokens"} for m in messages], template)
    assert int(plain.loss_mask.sum()) > int(r.loss_mask.sum())
