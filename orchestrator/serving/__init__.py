"""Serving: the OpenAI-compatible Ray Serve application over the disaggregated workers."""

from orchestrator.serving.app import SpecServeConfig, SpecServer, build_app

__all__ = ["SpecServeConfig", "SpecServer", "build_app"]
