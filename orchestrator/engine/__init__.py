"""Engines: target-only decoding (the lossless baseline), sampling, the vLLM backend, throughput benchmark."""

from orchestrator.engine.decode import Generation, TargetDecoder
from orchestrator.engine.sampling import SamplingParams, probabilities, sample

__all__ = ["Generation", "SamplingParams", "TargetDecoder", "probabilities", "sample"]
