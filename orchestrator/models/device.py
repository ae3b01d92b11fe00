"""Where and in what precision a model runs: one rule for every worker, actor and job.

device "auto": CUDA when the process was given a GPU (Ray sets CUDA_VISIBLE_DEVICES) and one is visible,
               else the CPU
dtype  "auto": bfloat16 on CUDA, float32 on the CPU (bf16 matmuls are slow on most CPUs)
"""

from __future__ import annotations

from typing import Literal

import torch

from orchestrator.errors import AerieError

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_name(name: str, num_gpus: float) -> str:
    """A worker's device from its config, before it starts: `auto` is its GPU when it reserves one (`num_gpus`),
    else the CPU."""
    if name != "auto":
        return name
    return "cuda" if num_gpus > 0 else "cpu"


def dtype_name(name: str, device_type: str) -> str:
    """`auto` -> "bfloat16" on CUDA, "float32" elsewhere; otherwise `name` (engines that take names: vLLM)."""
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" else "float32"


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda:0 when a GPU is visible, else cpu; 'cuda' without a GPU is a clear error."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AerieError(f"device {name!r} was asked for but this process sees no GPU (use device: auto or cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 elsewhere; otherwise the named dtype."""
    if isinstance(name, torch.dtype):
        return name
    name = dtype_name(name, device.type)
    if name not in DTYPES:
        raise AerieError(f"dtype {name!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]
