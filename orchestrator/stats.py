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


def tau_ratio(a: np.ndarray, b: np.ndarray, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> dict:
    """Acceptance length of two drafter kinds and their ratio tau_a / tau_b, with bootstrap intervals over seeds
    and prompts. a, b: [seeds, prompts, 2] arrays of (drafted rounds, accepted drafts) per (training seed, prompt),
    the same prompts for both; tau = 1 + sum(accepted) / sum(drafted). Each resample draws seeds and prompts with
    replacement (the same draws for a and b: paired by prompt)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 3 or a.shape[-1] != 2 or b.ndim != 3 or a.shape[1] != b.shape[1] or not a.shape[1]:
        raise ValueError(f"tau_ratio needs [seeds, prompts, 2] arrays over the same prompts (got {a.shape}, {b.shape})")

    def tau(x: np.ndarray) -> np.ndarray:  # [..., seeds, prompts, 2] -> [...]
        drafted = x[..., 0].sum(axis=(-1, -2))
        return 1 + x[..., 1].sum(axis=(-1, -2)) / np.maximum(drafted, 1)

    rng = np.random.default_rng(seed)
    n = a.shape[1]
    prompts = rng.integers(0, n, size=(resamples, n))

    def resampled(x: np.ndarray) -> np.ndarray:
        seeds = rng.integers(0, x.shape[0], size=(resamples, x.shape[0]))
        return x[seeds[:, :, None], prompts[:, None, :]]  # [resamples, seeds, prompts, 2]

    ta, tb = tau(resampled(a)), tau(resampled(b))
    tail = (1 - level) / 2

    def interval(values: np.ndarray) -> list[float]:
        return [float(v) for v in np.quantile(values, [tail, 1 - tail])]

    return {
        "tau_a": float(tau(a)),
        "tau_a_interval": interval(ta),
        "tau_b": float(tau(b)),
        "tau_b_interval": interval(tb),
        "ratio": float(tau(a) / tau(b)),
        "ratio_interval": interval(ta / tb),
        "seeds": [a.shape[0], b.shape[0]],
        "prompts": n,
    }
