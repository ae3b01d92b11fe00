"""Training checkpoints without pickle: the drafter in its vLLM layout, optimizer moments as safetensors,
counters as JSON.

    CKPT/drafter/{config.json, model.safetensors}   the drafter (save_drafter / load_drafter)
    CKPT/optimizer.safetensors                       AdamW exp_avg / exp_avg_sq per parameter name
    CKPT/progress.json                               step, elapsed time, optimizer step counts
    CKPT/data-rank{r}.json                           worker r's position in its data stream
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from orchestrator.models.checkpoint import load_drafter, save_drafter
from orchestrator.models.drafter import Drafter


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    elapsed_s: float = 0.0  # training time so far, over all attempts
    tokens: int = 0  # tokens trained on (all workers)


@dataclass
class DataPosition:
    """Where a worker's data stream is. A checkpoint resumes it exactly (the epoch's stream from `first_shard`,
    `consumed` sequences skipped); a committed drafter trained on later (`continue_from`) starts a new stream at
    `shards_read` (`continue_at`), so online capture never redoes what was read, and the sequences waiting in the
    shuffle buffer at the stop are not seen this epoch."""

    epoch: int = 0
    consumed: int = 0  # sequences taken from this epoch's stream
    shards_read: int = 0  # this epoch's shards (in its shuffled order) read whole into the shuffle buffer
    first_shard: int = 0  # where this epoch's stream began in that order

    def continue_at(self) -> DataPosition:
        """A new stream after the shards this one read whole."""
        return DataPosition(self.epoch, 0, self.shards_read, self.shards_read)


def save_state(out: Path, drafter: Drafter, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    save_drafter(drafter, out / "drafter")
    names = {id(p): n for n, p in drafter.named_parameters()}
    moments, steps = {}, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            name = names[id(p)]
            moments[f"{name}.exp_avg"] = state["exp_avg"].contiguous()
            moments[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].contiguous()
            steps[name] = float(state["step"])
    save_file(moments, str(out / "optimizer.safetensors"))
    (out / "progress.json").write_text(json.dumps({**asdict(progress), "optimizer_steps": steps}, indent=2))


def load_state(src: Path, drafter: Drafter, optimizer: torch.optim.Optimizer) -> Progress:
    """Restore weights and optimizer moments in place; returns the progress counters."""
    saved = load_drafter(src / "drafter")
    drafter.load_state_dict(saved.state_dict())
    moments = load_file(str(src / "optimizer.safetensors"))
    info = json.loads((src / "progress.json").read_text())
    for name, p in drafter.named_parameters():
        if name in info["optimizer_steps"]:
            optimizer.state[p] = {
                "step": torch.tensor(info["optimizer_steps"][name]),
                "exp_avg": moments[f"{name}.exp_avg"],
                "exp_avg_sq": moments[f"{name}.exp_avg_sq"],
            }
    return Progress(info["step"], info["elapsed_s"], info["tokens"])


def save_position(out: Path, rank: int, position: DataPosition) -> None:
    (out / f"data-rank{rank}.json").write_text(json.dumps(asdict(position)))


def load_position(src: Path, rank: int) -> DataPosition:
    path = src / f"data-rank{rank}.json"
    return DataPosition(**json.loads(path.read_text())) if path.is_file() else DataPosition()
