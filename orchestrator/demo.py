"""`aerie demo`: the same prompts answered by the target alone and with an EAGLE-3.1 drafter speculating, one user
at a time, the two interleaved and repeated; prints each answer with its acceptance length and the speed-up.

    for each prompt, repeat r:  target-only ──┐  (order alternates: ABBA...)   same tokens? (lossless, greedy)
                                speculative ──┘                               tau = 1 + accepted / rounds
    speed-up = sum of target-only seconds / sum of speculative seconds, 95% bootstrap interval over the pairs
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from orchestrator.engine import load_engine
from orchestrator.errors import AerieError
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.proposer import SpecConfig
from orchestrator.spec.sampling import SamplingParams
from orchestrator.stats import format_ratio, paired_ratio


def run_demo(
    model_dir: Path,
    drafter_dir: Path,
    prompts: list[list[int]],
    labels: list[str],
    spec: SpecConfig,
    max_tokens: int,
    repeats: int,
    dtype: str = "auto",
) -> dict:
    """labels: what to show of each prompt (the user's message); dtype: of both engines' models."""
    from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    engines = {
        "target-only": load_engine(model_dir, None, None, 1, tokenizer, eos, dtype=dtype),
        "speculative": load_engine(model_dir, drafter_dir, spec, 1, tokenizer, eos, dtype=dtype),
    }
    params = SamplingParams(max_tokens=max_tokens)
    for engine in engines.values():  # first calls pay one-time costs (oneDNN weight packing, allocations)
        engine.generate([prompts[0]], SamplingParams(max_tokens=8))
    pairs: list[tuple[float, float]] = []
    rows, overall = [], Acceptance()
    with tqdm(total=len(prompts) * repeats * 2, desc="demo", unit="gen") as bar:
        for i, ids in enumerate(prompts):
            outputs: dict[str, list[int]] = {}
            acceptance = Acceptance()
            for r in range(repeats):
                order = list(engines) if (i + r) % 2 == 0 else list(engines)[::-1]
                seconds = {}
                for mode in order:
                    began = time.perf_counter()
                    (g,) = engines[mode].generate([ids], params)
                    seconds[mode] = time.perf_counter() - began
                    outputs[mode] = g.token_ids
                    if mode == "speculative" and r == 0:
                        acceptance = g.acceptance
                    bar.update()
                pairs.append((seconds["target-only"], seconds["speculative"]))
            same = outputs["target-only"] == outputs["speculative"]
            overall += acceptance
            rows.append(
                {
                    "prompt": labels[i],
                    "answer": tokenizer.decode(outputs["speculative"], skip_special_tokens=True).strip(),
                    "tokens": len(outputs["speculative"]),
                    "acceptance_length": acceptance.acceptance_length,
                    "identical": same,
                    "target_only_s": sum(p[0] for p in pairs[-repeats:]) / repeats,
                    "speculative_s": sum(p[1] for p in pairs[-repeats:]) / repeats,
                }
            )
    total = sum(r["tokens"] for r in rows)
    return {
        "rows": rows,
        "identical": all(r["identical"] for r in rows),
        "acceptance_length": overall.acceptance_length,
        "speedup": paired_ratio([p[0] for p in pairs], [p[1] for p in pairs]),
        "tokens_per_s": {
            "target-only": total * repeats / sum(p[0] for p in pairs),
            "speculative": total * repeats / sum(p[1] for p in pairs),
        },
        "spec": spec.model_dump(),
        "repeats": repeats,
        "dtype": dtype,
    }


def format_demo(result: dict) -> str:
    lines = []
    for n, r in enumerate(result["rows"], start=1):
        check = "same tokens as the target alone" if r["identical"] else "DIFFERENT from the target alone"
        lines += [
            f"--- {n}. {r['prompt']}",
            r["answer"],
            f"    [{r['tokens']} tokens; acceptance length {r['acceptance_length']:.2f}; "
            f"{r['tokens'] / r['target_only_s']:.1f} -> {r['tokens'] / r['speculative_s']:.1f} tok/s; {check}]",
            "",
        ]
    s = result["spec"]
    shape = f"chain of {s['num_spec_tokens']}"
    if s["method"] == "tree":
        shape = f"tree of depth {s['depth']}, {s['budget']} nodes"
    tps = result["tokens_per_s"]
    lines += [
        f"EAGLE-3.1 speculation ({shape}, {result.get('dtype', 'auto')}), one user, greedy, {result['repeats']} "
        "interleaved repeats per prompt:",
        f"  acceptance length (tokens per target forward): {result['acceptance_length']:.2f}",
        f"  target alone {tps['target-only']:.1f} tok/s, speculative {tps['speculative']:.1f} tok/s: "
        f"speed-up {format_ratio(result['speedup'])} (95% interval over prompts x repeats)",
        "  lossless: " + ("every answer token for token the target's own" if result["identical"] else "NO"),
    ]
    return "\n".join(lines)


def check_identical(result: dict) -> None:
    if not result["identical"]:
        raise AerieError("speculative output differs from the target's own greedy output (a losslessness bug)")
