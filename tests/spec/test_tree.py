"""Tree attention masks and positions."""

from __future__ import annotations

import torch

from orchestrator.spec.tree import BestFirst, DraftTree


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


def _best_first(trees, take_while=lambda tree, node: True) -> list[tuple[int, int]]:
    order, out = BestFirst(trees), []
    while (best := order.pop()) is not None:
        if take_while(*best):
            order.take(*best)
            out.append(best)
    return out


def test_best_first_takes_nodes_by_score_across_trees_parents_and_earlier_siblings_first():
    a = ([-1, 0, -1], [-0.1, -0.2, -1.5])  # a:1 under a:0; a:2 a later sibling of a:0
    b = ([-1, -1], [-0.9, -0.05])  # b:1 scores best but was drawn after b:0
    assert _best_first([a, b]) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]


def test_best_first_keeps_a_skipped_nodes_subtree_and_later_siblings_out():
    a = ([-1, 0, 1, -1], [-0.1, -0.2, -0.3, -0.4])
    assert _best_first([a], lambda tree, node: node != 1) == [(0, 0), (0, 3)]
