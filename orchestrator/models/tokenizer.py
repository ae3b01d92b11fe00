"""Tokenizer and end-of-sequence ids of a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: str | Path, tokenizer) -> list[int]:
    """EOS ids as `generate` uses them: generation_config.json, else config.json, plus the tokenizer's."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
                break
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
