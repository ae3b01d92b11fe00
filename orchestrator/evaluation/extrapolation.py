"""The EAGLE-3.1 claim, tested: drafters of both kinds trained on the same short, single-template data with the
same budget, several seeds each, then evaluated where the training data never went.

    collect (short conversations, one template, one system prompt)
      ──> train: for each seed, for each variant (same config, `drafter.seed` = `seed` = the seed)
      ──> evaluate all drafters on the same prompts (greedy chain, the project's engine):
            held-out conversations of the training distribution, MT-Bench under the training template,
            long contexts (1k / 2k / 4k), unseen chat templates, out-of-distribution system prompts
      ──> per condition: tau of each variant and tau_3.1 / tau_3 with 95% bootstrap intervals over seeds and
          prompts (`stats.tau_ratio`) ──> table.md, result.json, plot, one MLflow run

Every stage is skipped when its output is there with the same inputs (state.json), so a rerun resumes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from pydantic import Field

from orchestrator.config import StrictModel, load_config
from orchestrator.evaluation.evaluate import SetsConfig
from orchestrator.fingerprint import fingerprint
from orchestrator.spec.proposer import SpecConfig

log = logging.getLogger(__name__)

# condition -> the evaluation rows (set, label or "*") it pools
CONDITIONS: dict[str, list[tuple[str, str]]] = {
    "training distribution (held-out)": [("validation", "*")],
    "MT-Bench (both turns)": [("mtbench", "*")],
    "MT-Bench, training template": [("templates", "chatml-default")],
    "context <= 1024": [("long_context", "<=1024")],
    "context <= 2048": [("long_context", "<=2048")],
    "context <= 4096": [("long_context", "<=4096")],
    "unseen chat templates": [("templates", "llama3-template"), ("templates", "plain-template")],
    "out-of-distribution system prompts": [
        ("templates", "chatml-pirate"),
        ("templates", "chatml-reviewer"),
        ("templates", "chatml-empty-system"),
    ],
}


class ExtrapolationConfig(StrictModel):
    """`python -m jobs.extrapolation` settings: the collect and train job configs, what varies, the evaluation."""

    collect: str = Field(description="collect config of the short, single-template training data")
    collect_overrides: list[str] = Field([], description="key=value overrides of the collect config")
    train: str = Field(description="train config: the budget and everything but variant, seed, name and paths")
    train_overrides: list[str] = Field(
        [], description="key=value overrides of the train config (the arm, seed, name and paths are set over them)"
    )
    sets: SetsConfig = Field(
        default_factory=lambda: SetsConfig(
            mtbench_questions=0,
            validation_prompts=12,
            long_context_buckets=[1024, 2048, 4096],
            long_context_per_bucket=3,
            template_prompts=3,
        ),
        description="evaluation prompts (the conditions pool their sets and labels)",
    )
    spec: SpecConfig = Field(
        default_factory=lambda: SpecConfig(method="chain", num_spec_tokens=5),
        description="the speculation method every drafter is evaluated with",
    )
    max_tokens: int = Field(96, ge=1, description="tokens generated per prompt (greedy, stops at EOS)")
    variants: list[str] = Field(["eagle3", "eagle3.1"], min_length=2, max_length=2, description="baseline, candidate")
    arms: dict[str, list[str]] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="instead of variants: two named sets of training overrides, baseline first, everything else "
        "equal (the same data, budget and seeds), e.g. {vocab-4096: [drafter.draft_vocab_size=4096], vocab-8192: "
        "[drafter.draft_vocab_size=8192]}: a recipe choice measured at equal training time",
    )

    def arm_overrides(self) -> dict[str, list[str]]:
        """Each compared arm's training overrides (the variants' by default)."""
        return self.arms or {v: [f"drafter.variant={v}"] for v in self.variants}

    seeds: list[int] = Field(
        [0, 1, 2], min_length=1, description="each arm is trained once per seed (drafter.seed and seed)"
    )
    output_dir: str = Field(
        description="state.json, the drafters, the evaluation, result.json, table.md and ratios.png"
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="None: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db"
    )
    mlflow_experiment: str = Field("aerie-experiments", description="MLflow experiment of the experiment's run")


def run_extrapolation(cfg: ExtrapolationConfig) -> dict:
    from orchestrator.data.collect import CollectConfig, run_collection
    from orchestrator.evaluation.evaluate import EvalConfig, run_evaluation
    from orchestrator.models.prepare import resolve_model
    from orchestrator.train.config import TrainConfig
    from orchestrator.train.run import run_training

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}

    def stage(key: str, inputs: dict, body, done) -> dict:
        fp = fingerprint(inputs)
        if key in state and state[key]["fingerprint"] == fp and done(state[key]["result"]):
            log.info("%s: done before, same inputs: skipped", key)
            return state[key]["result"]
        log.info("%s: running", key)
        result = body()
        state[key] = {"fingerprint": fp, "result": result}
        state_file.write_text(json.dumps(state, indent=2) + "\n")
        return result

    # every config is read and checked before the first stage starts
    collect = load_config(CollectConfig, cfg.collect, cfg.collect_overrides)
    model_dir = resolve_model(collect.model)
    tracking = [f"mlflow.tracking_uri={cfg.mlflow_tracking_uri}"] if cfg.mlflow_tracking_uri else []
    trains = {}
    arms = cfg.arm_overrides()
    for seed in cfg.seeds:
        for arm, overrides in arms.items():
            name = f"extrapolation-{arm}-seed{seed}"
            wiring = [
                *overrides,
                f"name={name}",
                f"data={collect.output}",
                f"output={out / 'drafters' / name}",
                f"drafter.seed={seed}",
                f"seed={seed}",
                "mlflow.registered_model=null",
                "mlflow.aliases=[]",
                *tracking,
            ]
            trains[name] = load_config(TrainConfig, cfg.train, [*cfg.train_overrides, *wiring])

    def collected() -> dict:
        result = run_collection(collect, model_dir)
        return {"output": result["output"], "tokens": result.get("total_tokens")}

    manifest = Path(collect.output) / "manifest.json"
    stage("collect", collect.model_dump(mode="json"), collected, lambda r: manifest.is_file())
    manifest_sha = fingerprint(manifest.read_text())
    trained = {}
    for name, tcfg in trains.items():
        trained[name] = stage(
            f"train {name}",
            {"config": tcfg.model_dump(mode="json"), "data": manifest_sha},
            lambda tcfg=tcfg: run_training(tcfg),
            lambda r: (Path(r["exported"]) / "config.json").is_file(),
        )
    drafters = [{"name": name, "source": r["exported"]} for name, r in trained.items()]
    ecfg = EvalConfig(
        model=collect.model,
        drafters=drafters,
        data=collect.output,
        sets=cfg.sets,
        methods={f"{cfg.spec.method}-{cfg.spec.shape()[2]}": cfg.spec},
        max_tokens=cfg.max_tokens,
        vllm_check=False,  # the engine's tau is vLLM's (checked by jobs.evaluate_drafter); 6+ drafters on CPU
        output_dir=str(out / "evaluate"),
        mlflow_tracking_uri=cfg.mlflow_tracking_uri,
    )
    evaluation = stage(
        "evaluate",
        {"config": ecfg.model_dump(mode="json"), "trained": {n: r["mlflow_run_id"] for n, r in trained.items()}},
        lambda: run_evaluation(ecfg),
        lambda r: "drafters" in r,  # kept whole in state.json
    )
    result = {
        "variants": list(arms),
        "seeds": cfg.seeds,
        "training": {n: {k: r[k] for k in ("steps", "tokens", "train_minutes")} for n, r in trained.items()},
        "conditions": conditions(evaluation, list(arms), cfg.seeds),
    }
    return _report(cfg, result, out)


def conditions(evaluation: dict, variants: list[str], seeds: list[int]) -> dict:
    """Per condition: tau per variant, the ratio candidate / baseline, intervals (stats.tau_ratio)."""
    from orchestrator.stats import tau_ratio

    labels = [tuple(x) for x in evaluation["prompt_labels"]]
    drafters = evaluation["drafters"]
    method = next(m for m in next(iter(drafters.values()))["engine"] if m != "draft_vocab_coverage")
    out = {}
    for condition, members in CONDITIONS.items():
        rows = [i for i, (s, label) in enumerate(labels) if any(s == ms and ml in ("*", label) for ms, ml in members)]
        if not rows:
            continue
        arrays = [
            np.array(
                [
                    [drafters[f"extrapolation-{v}-seed{seed}"]["engine"][method]["per_prompt"][i] for i in rows]
                    for seed in seeds
                ]
            )
            for v in variants
        ]
        r = tau_ratio(arrays[1], arrays[0])  # candidate / baseline
        out[condition] = {
            "method": method,
            variants[0]: {"tau": r["tau_b"], "interval": r["tau_b_interval"]},
            variants[1]: {"tau": r["tau_a"], "interval": r["tau_a_interval"]},
            "ratio": r["ratio"],
            "ratio_interval": r["ratio_interval"],
            "prompts": r["prompts"],
        }
    return out


def format_table(result: dict) -> str:
    base, cand = result["variants"]
    lines = [
        f"| condition | prompts | {base} tau [95%] | {cand} tau [95%] | {cand} / {base} [95%] |",
        "|---|---|---|---|---|",
    ]

    def cell(x: dict) -> str:
        return f"{x['tau']:.3f} [{x['interval'][0]:.3f}, {x['interval'][1]:.3f}]"

    for condition, c in result["conditions"].items():
        ratio = cell({"tau": c["ratio"], "interval": c["ratio_interval"]})
        lines.append(f"| {condition} | {c['prompts']} | {cell(c[base])} | {cell(c[cand])} | {ratio} |")
    lines.append(
        f"\n{len(result['seeds'])} seeds per variant; intervals: bootstrap over seeds and prompts (prompts paired)."
    )
    return "\n".join(lines)


def plot_ratios(result: dict, path: Path) -> Path:
    from orchestrator.evaluation.plots import _plt

    plt = _plt()
    names = list(result["conditions"])
    ratios = [result["conditions"][n]["ratio"] for n in names]
    lows = [r - result["conditions"][n]["ratio_interval"][0] for r, n in zip(ratios, names, strict=True)]
    highs = [result["conditions"][n]["ratio_interval"][1] - r for r, n in zip(ratios, names, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    ax.errorbar(ratios, range(len(names)), xerr=[lows, highs], fmt="o", capsize=3)
    ax.axvline(1.0, color="grey", linewidth=0.6)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    base, cand = result["variants"]
    ax.set_xlabel(f"tau {cand} / tau {base} (95% interval)")
    ax.set_title("Extrapolation: acceptance length ratio by condition")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _report(cfg: ExtrapolationConfig, result: dict, out: Path) -> dict:
    from mlflow.entities import Metric, Param

    from orchestrator.redaction import redact
    from orchestrator.tracking import client

    table = format_table(result)
    (out / "table.md").write_text(table + "\n")
    result["plot"] = str(plot_ratios(result, out / "ratios.png"))
    mlflow = client(cfg.mlflow_tracking_uri)
    exp = mlflow.get_experiment_by_name(cfg.mlflow_experiment)
    exp_id = exp.experiment_id if exp else mlflow.create_experiment(cfg.mlflow_experiment)
    run = mlflow.create_run(exp_id, run_name="extrapolation " + " vs ".join(result["variants"]))
    metrics = []
    for condition, c in result["conditions"].items():
        key = "".join(ch if ch.isalnum() else "_" for ch in condition).strip("_")
        metrics.append(Metric(f"ratio.{key}", c["ratio"], 0, 0))
        metrics += [Metric(f"tau.{v}.{key}", c[v]["tau"], 0, 0) for v in result["variants"]]
    params = [Param(k, str(v)[:500]) for k, v in redact(cfg.model_dump(mode="json")).items()]
    mlflow.log_batch(run.info.run_id, metrics=metrics, params=params)
    result["mlflow_run_id"] = run.info.run_id
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in ("table.md", "result.json", "ratios.png"):
        mlflow.log_artifact(run.info.run_id, str(out / name))
    mlflow.set_terminated(run.info.run_id)
    print(table)
    return result
