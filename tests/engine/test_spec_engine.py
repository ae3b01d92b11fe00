"""The in-process engine (the runtime's workers and scheduler, no Ray) is lossless: greedy output equals
target-only greedy decoding (and transformers' `generate`) token for token, whatever the proposer, batch size
or tree shape."""

from __future__ import annotations

import pytest
import torch

from orchestrator.data.prompts import PromptItem, encode_prompt, mtbench_first_turns
from orchestrator.engine import SpecEngine
from orchestrator.models import TargetModel
from orchestrator.runtime import DraftWorker, TargetWorker
from orchestrator.spec import EagleProposer, SamplingParams
from tests.helpers import ReplayProposer, random_drafter

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
SHORT_CHATS = ["Hi!", "What is 2 + 2?", "Name a color.", "Say hello in French."]
SPECS = {"chain": dict(depth=4, topk=1, budget=4), "tree": dict(depth=4, topk=3, budget=10)}


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return TargetModel.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """24 chat prompts, 20 MT-Bench first turns and 4 short ones: lengths from ~35 to ~190 tokens."""
    chats = [r["messages"] for r in mtbench_first_turns(20)] + [[{"role": "user", "content": c}] for c in SHORT_CHATS]
    return [encode_prompt(smollm2_tokenizer, PromptItem(0, messages=m)) for m in chats]


def _engine(target, proposer=None, budget: int = 0, batch: int = 8, eos=(2,), tokenizer=None) -> SpecEngine:
    draft = DraftWorker(proposer, batch) if proposer is not None else None
    return SpecEngine(TargetWorker(target, eos, batch), draft, budget, tokenizer)


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Target-only greedy decoding (EOS ignored so every prompt runs the full length)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [g.token_ids for g in _engine(target).generate(prompts, params)]


def test_target_only_equals_transformers_generate(smollm2_dir, prompts, reference):
    """Every third prompt (lengths ~35 to ~190 tokens, padded in the engine's batch of 8): transformers stops at
    EOS (min_new_tokens would instead forbid it), so compare up to the first EOS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt, expected in list(zip(prompts, reference, strict=True))[::3]:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt) :]
        until_eos = expected[: expected.index(2) + 1] if 2 in expected else expected
        assert out.tolist() == until_eos


def _proposer(kind: str, spec: str, target, prompts, reference, batch: int = 8):
    cfg = SPECS[spec]
    if kind == "replay":
        references = {"prompts": prompts, "outputs": reference}
        return ReplayProposer(references, target.vocab_size, cfg["depth"], width=cfg["topk"], seed=1)
    drafter = random_drafter(target.hf_config, "eagle3.1", draft_vocab_size=8192, seed=2, dtype=target.dtype)
    drafter.share_embedding(target.embed_tokens)
    return EagleProposer(drafter, cfg["depth"], cfg["topk"], max_requests=batch)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("spec", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["random-drafter", "replay"])
def test_greedy_speculation_is_exact(target, prompts, reference, kind, spec, batch):
    if batch == 1:  # one request at a time: 6 prompts (short and long) keep it to a fair share of the suite
        prompts, reference = prompts[-6:], reference[-6:]
    proposer = _proposer(kind, spec, target, prompts, reference, batch)
    engine = _engine(target, proposer, SPECS[spec]["budget"], batch)
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [g.token_ids for g in out] == reference
    if kind == "replay":
        cfg = SPECS[spec]
        total = sum((g.acceptance for g in out[1:]), out[0].acceptance)
        assert total.drafts > total.accepted_per_pos[0], "some rounds should accept nothing"
        deepest = len(total.accepted_per_pos)
        assert deepest == min(cfg["depth"], cfg["budget"] // cfg["topk"]), "some rounds should accept a full path"
        assert total.acceptance_length > 1.5


@pytest.fixture(scope="module")
def target_bf16(smollm2_dir):
    return TargetModel.from_pretrained(smollm2_dir, dtype="bfloat16")


@pytest.fixture(scope="module")
def reference_bf16(target_bf16, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [g.token_ids for g in _engine(target_bf16).generate(prompts, params)]


def test_bf16_target_only_decoding_on_the_cpu_is_the_same_alone_and_batched(target_bf16, prompts, reference_bf16):
    """Every third prompt alone against the batch of 8 (prompts of ~35 to ~190 tokens, prefilled together): the
    same tokens. One product for all rows changed 11 of 24 answers."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = _engine(target_bf16, batch=1).generate(prompts[::3], params)
    assert [g.token_ids for g in alone] == reference_bf16[::3]


@pytest.mark.parametrize(("kind", "spec"), [("replay", "tree"), ("random-drafter", "chain")])
def test_greedy_speculation_is_exact_in_bfloat16_on_the_cpu(target_bf16, prompts, reference_bf16, kind, spec):
    """bf16 on the CPU: a verify step gives each token the bits a decode step gives it (row-exact products and
    attention, `models.layers`), so speculation still equals target-only decoding. With PyTorch's flash attention
    and one product for all rows, 12 of 40 MT-Bench answers did."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    proposer = _proposer(kind, spec, target_bf16, prompts, reference_bf16)
    out = _engine(target_bf16, proposer, SPECS[spec]["budget"]).generate(prompts, params)
    assert [g.token_ids for g in out] == reference_bf16
    total = sum((g.acceptance for g in out[1:]), out[0].acceptance)
    assert total.drafts > 0


def test_stop_conditions_inside_an_accepted_path(target, prompts, reference):
    """The replayed path runs past EOS / max_tokens / a stop string: the output stops exactly there."""
    ref = reference[0]
    eos = ref[6]
    cut = ref.index(eos) + 1
    replay = {"prompts": [prompts[0]], "outputs": [ref]}
    engine = _engine(target, ReplayProposer(replay, target.vocab_size, depth=8), 8, 1, eos=[eos])
    (g,) = engine.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS))
    assert g.token_ids == ref[:cut] and g.finish_reason == "stop"

    engine = _engine(target, ReplayProposer(replay, target.vocab_size, depth=8), 8, 1)
    (g,) = engine.generate([prompts[0]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert g.token_ids == ref[:5] and g.finish_reason == "length"


def test_stop_string_cuts_text(target, prompts, reference, smollm2_tokenizer):
    ref = reference[1]
    full = smollm2_tokenizer.decode(ref)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    replay = ReplayProposer({"prompts": [prompts[1]], "outputs": [ref]}, target.vocab_size, depth=6)
    engine = _engine(target, replay, 6, 1, tokenizer=smollm2_tokenizer)
    (g,) = engine.generate([prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,), ignore_eos=True))
    assert g.finish_reason == "stop" and g.text == full[: full.index(stop)]
    assert stop in smollm2_tokenizer.decode(g.token_ids) and stop not in smollm2_tokenizer.decode(g.token_ids[:-1])


def test_requests_with_different_settings_share_a_batch(target, prompts, reference):
    drafter = random_drafter(target.hf_config, "eagle3", draft_vocab_size=8192, seed=3)
    drafter.share_embedding(target.embed_tokens)
    engine = _engine(target, EagleProposer(drafter, 3, 2, max_requests=4), 5, 4)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(max_tokens=7, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    out = engine.generate(prompts[:4], params)
    assert out[0].token_ids == reference[0] and out[3].token_ids == reference[3]
    assert out[1].token_ids == reference[1][:7]
    alone = _engine(target, EagleProposer(drafter, 3, 2, max_requests=1), 5, 1)
    assert alone.generate([prompts[2]], params[2])[0].token_ids == out[2].token_ids  # same seed, same tokens
