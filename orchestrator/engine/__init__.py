"""Engines in this process: the project's speculative engine (the runtime's workers and scheduler, no Ray)
and vLLM as a generation backend."""

from orchestrator.engine.engine import Generation, SpecEngine, load_engine

__all__ = ["Generation", "SpecEngine", "load_engine"]
