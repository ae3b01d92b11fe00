"""TargetModel against transformers' own Llama, and its KV cache against full-sequence forwards."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import AerieError
from orchestrator.models.target import TargetModel, read_hf_config


def _hf_reference(model_dir, seqs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(s[None], output_hidden_states=True) for s in seqs]


def _ragged(vocab: int, lengths, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def _forward_all(model: TargetModel, seqs):
    cache = model.new_cache(len(seqs), 512)
    num = torch.tensor([len(s) for s in seqs])
    return model(torch.cat(seqs), cache, torch.arange(len(seqs)), num)


def _compare(model, refs, seqs, logit_tol):
    out = _forward_all(model, seqs)
    hidden = model.hidden_size
    offset = 0
    for seq, ref in zip(seqs, refs, strict=True):
        n = len(seq)
        rows = slice(offset, offset + n)
        assert (out.logits[rows] - ref.logits[0]).abs().max().item() < logit_tol
        aux = out.aux_hidden[rows].view(n, len(model.aux_layer_ids), hidden)
        for j, layer_id in enumerate(model.aux_layer_ids):
            expected = ref.hidden_states[layer_id][0]
            torch.testing.assert_close(aux[:, j], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        final = ref.hidden_states[-1][0]  # transformers' last entry is after the final norm
        torch.testing.assert_close(out.final_hidden[rows], final, rtol=1e-5, atol=1e-5 * final.abs().max().item())
        offset += n


@pytest.mark.parametrize("packed", [False, True])
def test_tiny_random_llama_matches_transformers(tiny_dir, packed):
    seqs = _ragged(96, (9, 1, 17, 4))
    model = TargetModel.from_pretrained(tiny_dir, aux_layer_ids=(0, 2, 5), packed=packed)
    _compare(model, _hf_reference(tiny_dir, seqs), seqs, logit_tol=1e-4)


def test_smollm2_matches_transformers(smollm2_dir, chat_prompts):
    """Ragged batch of real chat prompts and random tokens; default aux layers (2, 15, 27)."""
    seqs = [torch.tensor(p) for p in chat_prompts[:3]] + _ragged(49152, (5, 23))
    refs = _hf_reference(smollm2_dir, seqs)
    exact = TargetModel.from_pretrained(smollm2_dir, packed=False)
    assert exact.aux_layer_ids == (2, 15, 27)
    _compare(exact, refs, seqs, logit_tol=1e-4)
    # oneDNN-packed weights (the fast default) round differently; SmolLM2's hidden states reach ~2.6e4, so the
    # logits move by ~1e-4, as much as transformers' sdpa and eager attention differ from each other.
    _compare(TargetModel.from_pretrained(smollm2_dir), refs, seqs, logit_tol=3e-4)


def test_single_sequence_is_bitwise_transformers(smollm2_dir, chat_prompts):
    seq = torch.tensor(chat_prompts[0])
    (ref,) = _hf_reference(smollm2_dir, [seq])
    out = _forward_all(TargetModel.from_pretrained(smollm2_dir, packed=False), [seq])
    assert torch.equal(out.logits, ref.logits[0])


@pytest.mark.parametrize("packed", [False, True])
def test_kv_cache_decoding_equals_full_forward(tiny_dir, packed):
    model = TargetModel.from_pretrained(tiny_dir, packed=packed)
    seqs = _ragged(96, (12, 7, 10), seed=3)
    full = _forward_all(model, seqs)
    cache = model.new_cache(3, 64)
    slots = torch.arange(3)
    prefix = [4, 1, 6]  # prefill a prefix, then one token per step (sequences end at different steps)
    model(torch.cat([s[:p] for s, p in zip(seqs, prefix, strict=True)]), cache, slots, torch.tensor(prefix))
    got = {i: [] for i in range(3)}
    for step in range(12):
        live = [i for i in range(3) if prefix[i] + step < len(seqs[i])]
        if not live:
            break
        tokens = torch.stack([seqs[i][prefix[i] + step] for i in live])
        out = model(tokens, cache, torch.tensor(live), torch.ones(len(live), dtype=torch.long))
        for row, i in enumerate(live):
            got[i].append(out.logits[row])
    offset = 0
    for i, seq in enumerate(seqs):
        expected = full.logits[offset + prefix[i] : offset + len(seq)]
        torch.testing.assert_close(torch.stack(got[i]), expected, rtol=1e-4, atol=1e-4)
        offset += len(seq)


def test_tree_block_then_keep_equals_feeding_only_kept(tiny_dir):
    """Append a 5-node tree under a tree mask, keep the path 0 -> 2 -> 4, then decode: same as feeding it."""
    model = TargetModel.from_pretrained(tiny_dir, packed=False)
    prompt, tree = torch.tensor([5, 9, 13, 21]), torch.tensor([30, 31, 32, 33, 34])
    parents = [-1, 0, 0, 1, 2]  # node 4 hangs under node 2, which hangs under node 0
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = torch.zeros(5, dtype=torch.long)
    for node, parent in enumerate(parents):
        mask[node, node] = True
        if parent >= 0:
            mask[node] |= mask[parent]
            depth[node] = depth[parent] + 1
    cache = model.new_cache(1, 64)
    slot, one = torch.tensor([0]), torch.tensor([1])
    model(prompt, cache, slot, torch.tensor([4]))
    tree_out = model(tree, cache, slot, torch.tensor([5]), positions=4 + depth, block_mask=mask[None])
    cache.keep_appended([0], [torch.tensor([0, 2, 4])])
    assert int(cache.lengths[0]) == 7
    after = model(torch.tensor([40]), cache, slot, one).logits

    ref_cache = model.new_cache(1, 64)
    path = torch.tensor([30, 32, 34])
    ref = model(torch.cat([prompt, path]), ref_cache, slot, torch.tensor([7])).logits
    torch.testing.assert_close(tree_out.logits[[0, 2, 4]], ref[4:], rtol=1e-5, atol=1e-5)
    ref_after = model(torch.tensor([40]), ref_cache, slot, one).logits
    torch.testing.assert_close(after, ref_after, rtol=1e-5, atol=1e-5)


def test_aux_layer_ids_outside_the_model_are_rejected(tiny_dir):
    config = read_hf_config(tiny_dir)
    with pytest.raises(AerieError, match=r"outside this 8-layer model"):
        TargetModel(config, aux_layer_ids=(2, 8))
    with pytest.raises(AerieError, match="strictly increasing"):
        TargetModel(config, aux_layer_ids=(3, 2))


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(AerieError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "nope")


def _tree_mask(parents: list[int], width: int) -> torch.Tensor:
    """[width, width] bool: node t sees itself and its ancestors (padding rows and columns False)."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    for t in range(len(parents)):
        node = t
        while node >= 0:
            mask[t, node] = True
            node = parents[node]
    return mask


def _depths(parents: list[int]) -> torch.Tensor:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor(depth)


def test_ragged_batch_on_scattered_slots_equals_each_sequence_alone(tiny_dir):
    """A sequence's logits in a ragged batch on scattered slots (prefill, a one-token decode, then a draft tree's
    verification) are those of the sequence alone: its masks and its share of the padded attention are right."""
    model = TargetModel.from_pretrained(tiny_dir, packed=False)
    prompts = _ragged(model.vocab_size, [3, 17, 9], seed=3)
    trees = [[-1, 0, 0, 1], [-1, 0], [-1, 0, 1, 1, 2]]
    nexts = _ragged(model.vocab_size, [1, 1, 1], seed=4)
    drafts = _ragged(model.vocab_size, [len(t) for t in trees], seed=5)

    def run(which: list[int]) -> list[list[torch.Tensor]]:
        cache = model.new_cache(4, 64)
        slots = torch.tensor([3, 0, 2])[which]
        per_seq = [[] for _ in which]

        def forward(tokens, **kw):
            num = torch.tensor([len(t) for t in tokens])
            out = model(torch.cat(tokens), cache, slots, num, **kw).logits
            for i, rows in enumerate(out.split(num.tolist())):
                per_seq[i].append(rows)

        forward([prompts[i] for i in which])
        forward([nexts[i] for i in which])
        width = max(len(trees[i]) for i in which)
        block = torch.stack([_tree_mask(trees[i], width) for i in which])
        positions = torch.cat([len(prompts[i]) + 1 + _depths(trees[i]) for i in which])
        forward([drafts[i] for i in which], positions=positions, block_mask=block)
        return per_seq

    together = run([0, 1, 2])
    for i in range(3):
        for alone, got in zip(run([i])[0], together[i], strict=True):
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_folded_grouped_query_attention_equals_enable_gqa(masked):
    """CUDA's attention (query heads folded into rows over their shared key/value head, the mask an additive bias)
    computes what `enable_gqa` with a bool mask does: here on the CPU's math kernel, in float32."""
    from orchestrator.models.layers import _attend, gqa_bias

    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, t, span, hd = 3, 8, 2, 5, 21, 16
    q = torch.randn(b, t, heads, hd, generator=gen).transpose(1, 2)  # strided as the model's padded queries
    keys, values = (torch.randn(b, kv_heads, span, hd, generator=gen) for _ in range(2))
    mask = torch.rand(b, 1, t, span, generator=gen) < 0.7 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    bias = gqa_bias(mask, b, heads // kv_heads, t, span, q.dtype, q.device)
    assert bias.shape == (b, 1, heads // kv_heads * t, span) and bias.stride(-2) % 16 == 0
    torch.testing.assert_close(_attend(q, keys, values, mask, bias), _attend(q, keys, values, mask, None))


def test_a_forward_builds_its_attention_bias_once(tiny_dir):
    """On CUDA every layer asks the forward's context for the bias: built by the first, the same tensor after."""
    from orchestrator.models.layers import AttentionContext

    model = TargetModel.from_pretrained(tiny_dir, packed=False)
    cache = model.new_cache(2, 64)
    ctx = AttentionContext.build(cache, torch.tensor([0, 1]), torch.tensor([3, 5]), None, None, model.inv_freq)
    heads, kv_heads = model.cfg.num_attention_heads, model.cfg.num_key_value_heads
    q = torch.zeros(2, heads, 5, model.cfg.head_dim)
    bias = ctx.bias(q, kv_heads)
    assert bias.shape == (2, 1, heads // kv_heads * 5, 5) and ctx.bias(q, kv_heads) is bias
    assert bool(torch.isinf(bias[0, 0, 0, 1])) and bias[1, 0, 4, 4] == 0  # causal: row 0 hides key 1


@torch.inference_mode()
def test_bf16_attention_on_the_cpu_gives_a_tree_node_the_bits_of_its_decode_step():
    """A tree node verified beside masked siblings (and padding keys past its block) against the same query decoded
    alone over its visible keys, back to back: equal to the bit, and close to the reference attention."""
    from orchestrator.models.layers import _attend

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, prefix = 9, 3, 64, 100
    parents = [-1, 0, 0, 1, 1, 3, 2, 5, 6, 7, 4, 10, 11, 8]  # block row -> parent row
    t = len(parents)
    keys, values = (torch.randn(1, kv_heads, prefix + t + 2, hd, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (3 * torch.randn(1, heads, t, hd, generator=gen)).to(torch.bfloat16)
    mask = torch.zeros(1, 1, t, prefix + t + 2, dtype=torch.bool)
    mask[..., :prefix] = True
    for row in range(t):
        node = row
        while node >= 0:
            mask[0, 0, row, prefix + node] = True
            node = parents[node]
    block = _attend(q, keys, values, mask, None)  # PyTorch's flash kernel: 32 of 70 rows differ (5 draws)
    for row in range(t):
        seen = mask[0, 0, row].nonzero().squeeze(1)  # its prefix and ancestors, in order
        alone = _attend(q[:, :, row : row + 1], keys[:, :, seen], values[:, :, seen], None, None)
        assert torch.equal(block[:, :, row], alone[:, :, 0]), f"row {row}"
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(block.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("fan_in", "fan_out"), [(576, 1536), (1536, 576)])
def test_bf16_products_on_the_cpu_give_each_row_the_bits_it_has_alone(fan_in, fan_out):
    """`RowBlockLinear` over 100 rows of SmolLM2's MLP shapes (one product of all rows: 15 rows of the up
    projection differ on an Intel CPU with AMX, where oneDNN switches kernels past 32; on an AMD EPYC a lone row of
    the down projection took another kernel than the same row beside others): each row as it is alone."""
    from torch import nn

    from orchestrator.models.layers import RowBlockLinear, row_exact_block

    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(fan_in, fan_out, bias=True).to(torch.bfloat16)
    block = RowBlockLinear(linear, row_exact_block(fan_in, fan_out))
    x = torch.randn(100, fan_in, generator=gen).to(torch.bfloat16)
    together = block(x)
    assert all(torch.equal(together[i], block(x[i : i + 1])[0]) for i in range(100))
    torch.testing.assert_close(together, linear(x), rtol=2e-2, atol=2e-2)
