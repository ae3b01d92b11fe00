"""The algorithms of speculative decoding, no Ray: sampling parameters, draft trees and best-first selection,
proposers (EAGLE chains and dynamic trees), lossless verification, acceptance counters."""

from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.proposer import EagleProposer, ProposeItem, Proposer, SpecConfig, load_eagle_proposer
from orchestrator.spec.sampling import SamplingParams, new_generator
from orchestrator.spec.tree import BestFirst, DraftTree, pack_trees
from orchestrator.spec.verify import Verdict, Verifier, probabilities, seeded_choice

__all__ = [
    "Acceptance",
    "BestFirst",
    "DraftTree",
    "EagleProposer",
    "ProposeItem",
    "Proposer",
    "SamplingParams",
    "SpecConfig",
    "Verdict",
    "Verifier",
    "load_eagle_proposer",
    "new_generator",
    "pack_trees",
    "probabilities",
    "seeded_choice",
]
