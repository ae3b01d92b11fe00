"""Acceptance evaluation of drafters (project engine and vLLM)."""

from orchestrator.evaluation.evaluate import EvalConfig, format_table, run_evaluation

__all__ = ["EvalConfig", "format_table", "run_evaluation"]
