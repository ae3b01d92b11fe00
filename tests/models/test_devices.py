"""Device mixing caught without a GPU: the training step, drafting and the target forward run with every
model tensor on PyTorch's `meta` device (shapes only). A tensor made on the CPU by mistake (`torch.arange(t)`
without `device=`, a CPU count stacked with device sums, a collective on a CPU tensor) meets a meta tensor and
raises "Tensor on device meta is not on the expected device cpu", exactly where CUDA would raise. The code keeps
its bookkeeping (slots, lengths, sizes) on the CPU by design; everything else follows the model's device.

Data-dependent steps (`.tolist()` of a verdict, tree building) cannot run on meta: they move their few values
to the host explicitly, and `make gpu-check` runs them on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.models.target import TargetModel
from orchestrator.train.objective import Batch, DraftTrainingModel
from tests.helpers import TINY_LLAMA

META = torch.device("meta")
AUX = (2, 4, 5)


def _drafter(device: torch.device) -> Drafter:
    config = DrafterConfig.for_target(TINY_LLAMA, AUX, draft_vocab_size=64, variant="eagle3.1")
    with device:
        return Drafter(config)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_training_step_forward_and_backward_stay_on_the_device(device):
    """The TTT objective (3 unrolled steps, forward KL) and its backward, on the model's device."""
    device = torch.device(device)
    hidden, vocab = TINY_LLAMA["hidden_size"], TINY_LLAMA["vocab_size"]
    drafter = _drafter(device)
    with device:
        model = DraftTrainingModel(drafter, torch.randn(vocab, hidden), torch.randn(64, hidden))
        b, t = 2, 12
        batch = Batch(
            input_ids=torch.randint(0, vocab, (b, t)),
            loss_mask=torch.ones(b, t, dtype=torch.bool),
            lengths=torch.tensor([t, t - 3]),
            aux_hidden=torch.randn(b, t, len(AUX) * hidden),
            final_hidden=torch.randn(b, t, hidden),
        )
    loss, stats = model(batch, steps=3, step_weight=0.8)
    loss.backward()
    assert loss.device == device and stats.as_tensor().device == device
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.device == device
    if device.type == "cpu":
        assert torch.isfinite(loss) and int(stats.count[0]) == (t - 2) + (t - 3 - 2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_target_forward_prefill_tree_verify_and_compaction(device, tiny_dir):
    """Prefill two sequences, verify a tree under a mask, keep an accepted path: weights and KV cache on the
    device, the scheduler's inputs (token ids, slots, counts) on the CPU as the workers pass them."""
    device = torch.device(device)
    reference = TargetModel.from_pretrained(tiny_dir, packed=False)
    if device.type == "meta":
        with META:
            model = TargetModel(reference.hf_config)
    else:
        model = reference
    cache = model.new_cache(4, 64)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    out = model(torch.randint(0, 96, (9,)), cache, slots, torch.tensor([5, 4]), logits="last")
    assert out.logits.device == device and out.logits.shape == (2, 96)
    assert out.aux_hidden.shape == (9, 3 * model.hidden_size)
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
    out = model(
        torch.randint(0, 96, (6,)),
        cache,
        slots,
        torch.tensor([3, 3]),
        positions=torch.tensor([5, 6, 6, 4, 5, 5]),
        block_mask=tree_mask.expand(2, -1, -1),
    )
    assert out.logits.device == device and out.logits.shape == (6, 96)
    cache.keep_appended([int(slots[0]), int(slots[1])], [torch.tensor([0, 2]), torch.tensor([0])])
    assert cache.lengths[slots].tolist() == [7, 5]
    out = model(torch.randint(0, 96, (2,)), cache, slots, torch.tensor([1, 1]))  # decode, ragged lengths
    assert out.logits.device == device


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_drafting_steps_stay_on_the_device(device):
    """A drafter's commit step (target states -> fc) and a tree depth under a mask with mask_start."""
    device = torch.device(device)
    drafter = _drafter(device)
    with device:
        drafter.share_embedding(torch.nn.Embedding(TINY_LLAMA["vocab_size"], TINY_LLAMA["hidden_size"]))
        aux = torch.randn(7, len(AUX) * TINY_LLAMA["hidden_size"])
    cache = drafter.new_cache(2, 64)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    last = torch.tensor([3, 6])  # each sequence's last row, the proposer's way
    out = drafter(torch.randint(0, 96, (7,)), drafter.combine_aux(aux), cache, slots, torch.tensor([4, 3]), rows=last)
    assert out.logits.device == device and out.next_hidden.device == device and out.logits.shape[0] == 2
    block = torch.ones(2, 2, 2, dtype=torch.bool)
    out = drafter(
        torch.randint(0, 96, (4,)),
        out.next_hidden.repeat_interleave(2, dim=0),
        cache,
        slots,
        torch.tensor([2, 2]),
        positions=torch.tensor([4, 4, 3, 3]),
        block_mask=block,
        mask_start=torch.tensor([4, 3]),
    )
    assert out.logits.device == device
    assert drafter.target_logits(out.logits).device == device


def test_the_one_device_and_dtype_rule():
    """auto: a worker's GPU when it reserves one, bf16 there, fp32 on the CPU; explicit names win."""
    from orchestrator.models.device import device_name, dtype_name, resolve_dtype

    assert device_name("auto", 1) == "cuda" and device_name("auto", 0) == "cpu" and device_name("cpu", 1) == "cpu"
    assert dtype_name("auto", "cuda") == "bfloat16" and dtype_name("auto", "cpu") == "float32"
    assert dtype_name("float16", "cpu") == "float16"
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
