"""Ratios with bootstrap confidence intervals: the one way benchmarks and experiments here report a comparison.

    paired_ratio([a_1..a_n], [b_1..b_n]) = mean(a) / mean(b), with a percentile interval from resampling the
    pairs (prompts, repeats, seeds: whatever the unit is) with replacement

A pair keeps a measurement next to its own baseline (same prompt, same moment of an interleaved run), so drift
of the machine and hardness of a prompt cancel in the ratio instead of widening it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def paired_ratio(
    a: Sequence[float], b: Sequence[float], level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> dict:
    """mean(a) / mean(b) and its bootstrap interval over the pairs: {"ratio", "low", "high", "n"}."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or not len(x):
        raise ValueError(f"paired_ratio needs two equally long, non-empty lists (got {x.shape} and {y.shape})")
    ratio = float(x.mean() / y.mean())
    if len(x) == 1:
        return {"ratio": ratio, "low": None, "high": None, "n": 1}
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    boot = x[idx].mean(axis=1) / y[idx].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    return {"ratio": ratio, "low": float(low), "high": float(high), "n": len(x)}


def format_ratio(r: dict, digits: int = 2) -> str:
    """'1.23x [1.10, 1.35]' (no interval from a single pair)."""
    if r["low"] is None:
        return f"{r['ratio']:.{digits}f}x (n=1)"
    return f"{r['ratio']:.{digits}f}x [{r['low']:.{digits}f}, {r['high']:.{digits}f}]"
