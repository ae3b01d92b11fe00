"""Speculation: draft trees, proposers (EAGLE chains and dynamic trees), lossless verification."""

from orchestrator.spec.proposer import EagleProposer, ProposeItem, Proposer
from orchestrator.spec.tree import DraftTree
from orchestrator.spec.verify import Verdict, Verifier

__all__ = ["DraftTree", "EagleProposer", "ProposeItem", "Proposer", "Verdict", "Verifier"]
