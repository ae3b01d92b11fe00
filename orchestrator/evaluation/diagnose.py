"""Attention drift, measured: where a drafter's attention goes at each drafting depth.

EAGLE-3.1's claim is that EAGLE-3 drafters drift: the deeper they draft, the more their attention leaves the
sink tokens (the first positions, where trained attention parks mass it does not need elsewhere) for their
own drafted tokens, and the drift grows with context length; `fc_norm` and `norm_output` keep it on the sinks.

    prompts at each context length (evaluation sets: earlier chitchat, then an MT-Bench question)
      ──> the target answers greedily (answer_tokens) ──> target forward: aux hidden states of every position
      ──> per drafter: the TTT unroll (`train.ttt.unroll`, exactly the served chain) with a probe on attention
      ──> for rows inside the answer, per depth d: attention mass on
            sinks     the first `sink_tokens` committed positions
            context   the rest of the committed prefix (target hidden states)
            own       the chain's own drafted positions (depths 2..d; none at depth 1)
          averaged over heads, layers and rows ──> table, plots per context, result.json, one MLflow run
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.evaluation.evaluate import DrafterRef
from orchestrator.redaction import redact

log = logging.getLogger(__name__)
PARTS = ("sinks", "context", "own")


class DiagnoseConfig(StrictModel):
    """`python -m jobs.diagnose_drafter` settings."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    models_dir: str = Field("models", description="where packaged models are prepared")
    drafters: list[DrafterRef] = Field(min_length=1, description="the drafters probed, on the same prompts")
    contexts: list[int] = Field([256, 1024, 4096], min_length=1, description="context lengths (tokens) to probe")
    prompts_per_context: int = Field(
        4, ge=1, description="prompts per context length (an MT-Bench question after earlier conversations)"
    )
    answer_tokens: int = Field(48, ge=2, description="greedy answer tokens whose drafting rows are measured")
    depth: int = Field(5, ge=1, description="drafting depths measured (a chain this long)")
    sink_tokens: int = Field(4, ge=1, description="the first positions counted as sinks")
    output_dir: str = Field(description="result.json, table.md and a plot per part")
    mlflow_tracking_uri: str | None = Field(
        None, description="None: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db"
    )
    mlflow_experiment: str = Field("aerie-diagnostics", description="MLflow experiment of the diagnosis's run")
    torch_threads: int = Field(2, ge=1, description="torch intra-op threads")


def attention_masses(drafter, input_ids: torch.Tensor, aux: torch.Tensor, rows: torch.Tensor, depth: int, sinks: int):
    """[depth, 3] mean attention mass on (sinks, context, own drafted) over `rows` of one sequence."""
    from orchestrator.train.ttt import unroll

    t = input_ids.numel()
    sums = torch.zeros(depth, 3)
    counts = torch.zeros(depth)

    def probe(step: int, layer: int, probs: torch.Tensor) -> None:
        p = probs[0, :, rows].float().mean(0)  # [rows, T + step]: averaged over heads
        parts = torch.stack([p[:, :sinks].sum(-1), p[:, sinks:t].sum(-1), p[:, t:].sum(-1)], dim=-1)
        sums[step] += parts.mean(0)
        counts[step] += 1

    with torch.no_grad():
        unroll(drafter, input_ids[None], aux[None].to(drafter.fc.weight.dtype), depth, probe)
    return sums / counts.clamp_min(1)[:, None]  # averaged over layers


def run_diagnosis(cfg: DiagnoseConfig) -> dict:
    from orchestrator.engine import load_engine
    from orchestrator.evaluation.sets import long_context_set
    from orchestrator.models.checkpoint import drafter_aux_layer_ids, load_drafter
    from orchestrator.models.prepare import resolve_model
    from orchestrator.models.target import TargetModel, load_safetensors_dir, read_hf_config
    from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer
    from orchestrator.spec.sampling import SamplingParams
    from orchestrator.tracking import fetch_drafter, tracking_uri

    torch.set_num_threads(cfg.torch_threads)
    model_dir = resolve_model(cfg.model, cfg.models_dir)
    drafters = {d.name: fetch_drafter(d.source, tracking=tracking_uri(cfg.mlflow_tracking_uri)) for d in cfg.drafters}
    hf = read_hf_config(model_dir)
    window = hf.get("max_position_embeddings", 2048) - cfg.answer_tokens - cfg.depth - 2
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    prompts = long_context_set(tokenizer, cfg.contexts, cfg.prompts_per_context, window)
    if not prompts:
        raise ValueError(f"no context in {cfg.contexts} fits the target's window ({window} tokens)")
    engine = load_engine(model_dir, max_batch=4, eos_token_ids=eos)
    params = SamplingParams(max_tokens=cfg.answer_tokens, ignore_eos=True)
    with bar(total=len(prompts), desc="target answers", unit="answer") as answered:
        answers = engine.generate([p.ids for p in prompts], params, progress=answered)
    del engine
    embed = load_safetensors_dir(model_dir, ["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()
    states: dict[tuple, list] = {}  # aux layer ids -> per prompt (ids, aux)
    result: dict = {"contexts": defaultdict(dict), "config": redact(cfg.model_dump(mode="json"))}
    for name, path in drafters.items():
        drafter = load_drafter(path, target_num_layers=hf["num_hidden_layers"])
        drafter.share_embedding(torch.nn.Embedding.from_pretrained(embed, freeze=True))
        layers = drafter_aux_layer_ids(path, hf["num_hidden_layers"])
        if layers not in states:
            states[layers] = _target_states(TargetModel, model_dir, layers, prompts, answers)
        per_context: dict[str, list] = defaultdict(list)
        for prompt, (ids, aux) in bar(
            iterable=zip(prompts, states[layers], strict=True), total=len(prompts), desc=name
        ):
            start = len(prompt.ids) - 1  # the committed pair before the answer's second token drafts it
            rows = torch.arange(start, ids.numel() - cfg.depth - 1)
            per_context[prompt.label].append(attention_masses(drafter, ids, aux, rows, cfg.depth, cfg.sink_tokens))
        for label, masses in per_context.items():
            mean = torch.stack(masses).mean(0)  # [depth, 3]
            result["contexts"][label][name] = {
                part: [round(float(v), 4) for v in mean[:, k]] for k, part in enumerate(PARTS)
            }
    result["contexts"] = dict(result["contexts"])
    result["prompts"] = {label: sum(p.label == label for p in prompts) for label in result["contexts"]}
    return _report(cfg, result)


def _target_states(target_cls, model_dir: Path, layers: tuple, prompts, answers) -> list:
    """(token ids, aux hidden states) of prompt + greedy answer, one target forward each."""
    target = target_cls.from_pretrained(model_dir, layers)
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor(prompt.ids + answer.token_ids)
        cache = target.new_cache(1, ids.numel())
        states = target(ids, cache, torch.tensor([0]), torch.tensor([ids.numel()]), logits="none")
        out.append((ids, states.aux_hidden.float().cpu()))
    return out


def format_table(result: dict) -> str:
    rows = ["| context | drafter | part | " + " | ".join(f"depth {d + 1}" for d in range(_depth(result))) + " |"]
    rows.append("|---|---|---|" + "---|" * _depth(result))
    for label, drafters in result["contexts"].items():
        for name, parts in drafters.items():
            for part in PARTS:
                rows.append(f"| {label} | {name} | {part} | " + " | ".join(f"{v:.3f}" for v in parts[part]) + " |")
    return "\n".join(rows)


def _depth(result: dict) -> int:
    first = next(iter(result["contexts"].values()))
    return len(next(iter(first.values()))["sinks"])


def plot_diagnosis(result: dict, out: Path) -> list[Path]:
    """One figure per part: mass by depth, a colour per drafter, a line style per context."""
    from orchestrator.evaluation.plots import _plt

    plt = _plt()
    paths = []
    for part in PARTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        styles = ["-", "--", ":", "-."]
        for k, (label, drafters) in enumerate(result["contexts"].items()):
            for i, (name, parts) in enumerate(drafters.items()):
                depths = list(range(1, len(parts[part]) + 1))
                style = dict(color=f"C{i}", linestyle=styles[k % len(styles)], marker="o")
                ax.plot(depths, parts[part], label=f"{name}, context {label}", **style)
        ax.set_xticks(depths)
        ax.set_xlabel("drafting depth")
        ax.set_ylabel(f"attention mass on {part}")
        ax.set_title(f"Drafter attention on {part} by depth")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"attention_{part}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _report(cfg: DiagnoseConfig, result: dict) -> dict:
    from mlflow.entities import Metric, Param

    from orchestrator.tracking import client

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(result)
    (out / "table.md").write_text(table + "\n")
    result["plots"] = [str(p) for p in plot_diagnosis(result, out)]
    mlflow = client(cfg.mlflow_tracking_uri)
    exp = mlflow.get_experiment_by_name(cfg.mlflow_experiment)
    exp_id = exp.experiment_id if exp else mlflow.create_experiment(cfg.mlflow_experiment)
    run = mlflow.create_run(exp_id, run_name="attention " + " vs ".join(d.name for d in cfg.drafters))
    metrics = [
        Metric(f"attn.{name}.{label.replace('<=', 'le')}.{part}", v, 0, d + 1)
        for label, drafters in result["contexts"].items()
        for name, parts in drafters.items()
        for part in PARTS
        for d, v in enumerate(parts[part])
    ]
    params = [Param(k, str(v)[:500]) for k, v in result["config"].items()]
    mlflow.log_batch(run.info.run_id, metrics=metrics, params=params[:100])
    result["mlflow_run_id"] = run.info.run_id
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    mlflow.log_artifacts(run.info.run_id, str(out))
    mlflow.set_terminated(run.info.run_id)
    print(table)
    return result
