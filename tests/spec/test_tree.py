"""Tree attention masks and positions."""

from __future__ import annotations

import torch

from orchestrator.spec.tree import DraftTree


def test_chain_mask_is_causal_and_depths_count_up():
    tree = DraftTree.chain([7, 8, 9])
    assert torch.equal(tree.attention_block(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.depths().tolist() == [1, 2, 3]


def test_branching_tree_mask_and_depths():
    #   root ─┬─ 0 ─┬─ 2
    #         │     └─ 3 ── 4
    #         └─ 1
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 3]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # 0
            [1, 0, 1, 0, 0, 0],  # 1: not its sibling 0
            [1, 1, 0, 1, 0, 0],  # 2: root, 0, itself
            [1, 1, 0, 0, 1, 0],  # 3: not its sibling 2
            [1, 1, 0, 0, 1, 1],  # 4: root, 0, 3, itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attention_block(), expected)
    assert tree.depths().tolist() == [1, 1, 2, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3]
    assert tree.path_to(4) == [0, 3, 4]


def test_empty_tree_is_just_the_root():
    tree = DraftTree.empty()
    assert tree.size == 0 and torch.equal(tree.attention_block(), torch.ones(1, 1, dtype=torch.bool))
