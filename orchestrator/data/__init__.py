"""Data: prompt files and built-in prompt sets."""

from orchestrator.data.prompts import (
    PromptItem,
    encode_prompt,
    mtbench_first_turns,
    mtbench_questions,
    read_prompt_file,
)

__all__ = ["PromptItem", "encode_prompt", "mtbench_first_turns", "mtbench_questions", "read_prompt_file"]
