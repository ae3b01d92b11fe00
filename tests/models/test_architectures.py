"""TargetModel against transformers for every architecture it runs (Llama, Mistral, Qwen2, Qwen3), and one clear
error, naming the vLLM backend, for everything else.

Each model is a tiny random one built on the spot by transformers (seeded), saved as safetensors and loaded by
`TargetModel.from_pretrained`. Biases and norm weights are perturbed (transformers initialises them to 0 and 1,
which would hide a bias or q/k norm that failed to load). `pytest -s` prints the comparison table.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import AerieError
from orchestrator.models.checkpoint import drafter_hf_config
from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.models.layers import fuse_layer_weights, split_layer_weights
from orchestrator.models.target import TargetModel, check_target_supported

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": None,  # greedy generation runs its full length in both implementations
    "pad_token_id": 0,
}
ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": None, "rope_theta": 1e6},  # as Mistral-7B-v0.3 and later
    "qwen2": {"tie_word_embeddings": True},  # q/k/v bias, no o_proj bias; small Qwen2.5 models tie
    "qwen3": {"head_dim": 32},  # q/k norms; head_dim 32 != 64 / 4
}
AUX_IDS = (1, 2, 3)
PROMPT_LENGTHS, DECODE_STEPS, GREEDY_TOKENS = (11, 7), 4, 16


def _write_model(model_type: str, out):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(list(ARCHS).index(model_type))  # four different models
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **ARCHS[model_type]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(out, safe_serialization=True)
    return model


def _teacher_forced(model: TargetModel, seqs: list[torch.Tensor]):
    """Prefill the prompts of both sequences packed, then DECODE_STEPS steps of one token each (the true next
    tokens); returns per sequence its logits [T, vocab] and aux states [T, k * hidden] in position order."""
    cache, slots = model.new_cache(len(seqs), 64), torch.arange(len(seqs))
    prompts = [s[: len(s) - DECODE_STEPS] for s in seqs]
    out = model(torch.cat(prompts), cache, slots, torch.tensor([len(p) for p in prompts]))
    logits = list(out.logits.cpu().split(PROMPT_LENGTHS))
    aux = list(out.aux_hidden.cpu().split(PROMPT_LENGTHS))
    for step in range(DECODE_STEPS):
        tokens = torch.stack([s[len(p) + step] for s, p in zip(seqs, prompts, strict=True)])
        out = model(tokens, cache, slots, torch.ones(len(seqs), dtype=torch.long))
        for b in range(len(seqs)):
            logits[b] = torch.cat([logits[b], out.logits[b : b + 1].cpu()])
            aux[b] = torch.cat([aux[b], out.aux_hidden[b : b + 1].cpu()])
    return logits, aux


def _greedy(model: TargetModel, prompts: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Greedy decoding of both prompts together through TargetModel.forward and its KV cache."""
    cache, slots = model.new_cache(len(prompts), 64), torch.arange(len(prompts))
    out = model(torch.cat(prompts), cache, slots, torch.tensor([len(p) for p in prompts]), logits="last")
    generated = [out.logits.argmax(-1).cpu()]
    for _ in range(steps - 1):
        out = model(generated[-1], cache, slots, torch.ones(len(prompts), dtype=torch.long), logits="last")
        generated.append(out.logits.argmax(-1).cpu())
    return torch.stack(generated, dim=1).tolist()


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict[str, dict]:
    """Every architecture built, saved, loaded and compared once; prints the table."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, COMMON["vocab_size"], (n + DECODE_STEPS,), generator=gen) for n in PROMPT_LENGTHS]
    results = {}
    for arch in ARCHS:
        model_dir = tmp_path_factory.mktemp(arch)
        hf = _write_model(arch, model_dir)
        ours = TargetModel.from_pretrained(model_dir, aux_layer_ids=AUX_IDS, dtype=torch.float32, packed=False)
        logits, aux = _teacher_forced(ours, seqs)
        logit_diff, aux_diff = 0.0, 0.0
        with torch.no_grad():
            for seq, our_logits, our_aux in zip(seqs, logits, aux, strict=True):
                ref = hf(seq[None], output_hidden_states=True)
                logit_diff = max(logit_diff, (our_logits - ref.logits[0]).abs().max().item())
                ref_aux = torch.cat([ref.hidden_states[i][0] for i in AUX_IDS], dim=-1)
                aux_diff = max(aux_diff, (our_aux - ref_aux).abs().max().item())
            prompts = [s[:n] for s, n in zip(seqs, PROMPT_LENGTHS, strict=True)]
            theirs = [
                hf.generate(p[None], max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(p) :].tolist()
                for p in prompts
            ]
        mine = _greedy(ours, prompts, GREEDY_TOKENS)
        results[arch] = {"logits": logit_diff, "aux": aux_diff, "greedy": mine == theirs, "model": ours, "hf": hf}
    print("\narch     logits max |diff|  aux max |diff|  greedy equal")
    for arch, r in results.items():
        print(f"{arch:8} {r['logits']:17.2e} {r['aux']:15.2e}  {r['greedy']}")
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_aux_states_match_transformers(compared, arch):
    """Packed prefill of 2 ragged prompts, then decode steps through the KV cache, against transformers."""
    assert compared[arch]["logits"] < 1e-4
    assert compared[arch]["aux"] < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(compared, arch):
    assert compared[arch]["greedy"], f"{arch}: greedy tokens differ from transformers' generate"


def test_architecture_specific_weights_loaded(compared):
    """The extras really are there (and were perturbed away from their zero / one init)."""
    qwen2, qwen3 = compared["qwen2"]["model"], compared["qwen3"]["model"]
    attn2, attn3 = qwen2.layers[0].self_attn, qwen3.layers[0].self_attn
    assert attn2.qkv_proj.bias is not None and attn2.o_proj.bias is None and attn2.qkv_proj.bias.abs().min() > 0
    assert attn3.q_norm.weight.shape == (32,) and attn3.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    assert attn3.qkv_proj.bias is None and not torch.equal(attn3.k_norm.weight, torch.ones(32))
    assert qwen2.lm_head.weight is qwen2.embed_tokens.weight


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_split_gives_back_hugging_face_names(compared, arch):
    """fuse_layer_weights then split_layer_weights returns the transformers layer, biases and norms included."""
    prefix = "model.layers.1."
    hf_state = {k: v for k, v in compared[arch]["hf"].state_dict().items() if k.startswith(prefix)}
    ours = compared[arch]["model"]
    fused = fuse_layer_weights(hf_state, prefix)
    assert fused.keys() == {k.removeprefix("layers.1.") for k in ours.state_dict() if k.startswith("layers.1.")}
    split = split_layer_weights(fused, ours.cfg)
    assert split.keys() == {k.removeprefix(prefix) for k in hf_state}
    assert all(torch.equal(split[k.removeprefix(prefix)], v) for k, v in hf_state.items())


def test_lone_bias_is_reported_not_dropped():
    tensors = {f"p.self_attn.{n}_proj.weight": torch.zeros(2, 2) for n in "qkv"} | {
        "p.self_attn.q_proj.bias": torch.zeros(2)
    }
    assert set(fuse_layer_weights(tensors, "p.")) == {"self_attn.qkv_proj.weight", "self_attn.q_proj.bias"}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_drafter_for_qwen_target_is_a_plain_llama_drafter(compared, arch):
    """vLLM's LlamaForCausalLMEagle3 has no q/k/v bias and no q/k norms: the drafter must not carry them."""
    target = compared[arch]["model"]
    config = DrafterConfig.for_target(target.hf_config, AUX_IDS, 100)
    assert not (config.decoder.qkv_bias or config.decoder.qk_norm or config.decoder.attention_bias)
    names = set(Drafter(config).state_dict())
    assert not any(n.endswith("qkv_proj.bias") or "q_norm" in n or "k_norm" in n for n in names)
    hf = drafter_hf_config(config)
    assert (hf["model_type"], hf["attention_bias"], hf["head_dim"]) == ("llama", False, target.cfg.head_dim)


def _config(model_type: str, **fields) -> dict:
    return {"model_type": model_type, **COMMON, **fields}


UNSUPPORTED = [
    ("gpt_neox", _config("gpt_neox"), r"model_type 'gpt_neox' is not supported by aerie's own target model"),
    ("deepseek_v3", _config("deepseek_v3"), r"model_type 'deepseek_v3' is not supported"),
    (
        "mistral v0.1 window",
        _config("mistral", sliding_window=4096, max_position_embeddings=32768),
        r"4096-token sliding window, shorter than its 32768-token context",
    ),
    (
        "qwen2 sliding layers",
        _config("qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=2),
        r"128-token sliding window",
    ),
    (
        "yarn rope",
        _config("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        r"rope scaling 'yarn' is not supported",
    ),
]


@pytest.mark.parametrize(("case", "hf", "message"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_targets_fail_with_one_clear_error_naming_vllm(case, hf, message):
    with pytest.raises(AerieError, match=message) as err:
        check_target_supported(hf)
    assert "use the vLLM backend for it (aerie serve --backend vllm" in str(err.value)
    with pytest.raises(AerieError, match=message):
        TargetModel(hf)


@pytest.mark.parametrize(
    "hf",
    [
        _config("mistral", sliding_window=256),  # the window covers the whole context: it never bites
        _config("qwen2", use_sliding_window=False, sliding_window=128, max_window_layers=2),  # Qwen2.5 configs
        _config("qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=4),  # no layer slides
        _config("qwen3", layer_types=["full_attention"] * 4, sliding_window=128),
    ],
)
def test_windows_that_never_bite_are_accepted(hf):
    check_target_supported(hf)
