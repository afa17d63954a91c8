"""What a cell reports, computed the same way for every engine.

- **Accuracy against a reference**: the worst coordinate's mean error in reference sds and the worst relative sd
  error; *accurate* means every mean within 0.1 sd and every sd within 10% (:data:`TOLERANCE_MEAN`,
  :data:`TOLERANCE_SD`).
- **Mixing**: bulk ESS (the smallest over coordinates) and split r_hat (the largest), by Pyro's
  ``pyro.ops.stats``; ESS per second of the whole run.
- **Prediction**: test NLL (nats per point), ECE (15 equal-width bins of the top-class probability) and accuracy.
- **Memory**: peak RSS above the RSS at the start of the cell (``VmHWM`` reset through ``/proc/self/clear_refs``,
  ``benchmarks/harness.py``).
"""

from __future__ import annotations

import math

import torch
from pyro.ops.stats import effective_sample_size, split_gelman_rubin
from torch import Tensor

__all__ = ["TOLERANCE_MEAN", "TOLERANCE_SD", "accuracy", "calibration", "diagnose", "mixing"]

TOLERANCE_MEAN, TOLERANCE_SD = 0.1, 0.10


def accuracy(draws: Tensor, mean: Tensor, sd: Tensor) -> dict:
    """Errors of ``draws`` (chains, draws, d) or (draws, d) against the reference moments."""
    flat = draws.reshape(-1, draws.shape[-1]).double()
    if not bool(torch.isfinite(flat).all()):
        return {"mean_error_sd": math.inf, "sd_error": math.inf, "accurate": False}
    mean_error = float(((flat.mean(0) - mean).abs() / sd).max())
    sd_error = float((flat.std(0) / sd - 1).abs().max())
    return {
        "mean_error_sd": round(mean_error, 4),
        "sd_error": round(sd_error, 4),
        "accurate": mean_error <= TOLERANCE_MEAN and sd_error <= TOLERANCE_SD,
    }


def mixing(draws: Tensor, seconds: float, halves: bool = False) -> dict:
    """Smallest bulk ESS, ESS per second and (with 2+ chains, or ``halves``) the largest split r_hat of (chains,
    draws, d) (:func:`diagnose`)."""
    ess, r_hat = diagnose(draws)
    out = {"ess_min": round(ess, 1), "ess_per_s": round(ess / seconds, 2)}
    if draws.shape[0] > 1 or halves:
        out["r_hat_max"] = round(r_hat, 4)
    return out


def diagnose(draws: Tensor) -> tuple[float, float]:
    """Smallest ESS and largest split r_hat of (chains, draws, d); one chain is split into its two halves for r_hat."""
    draws = draws.double()
    ess = float(effective_sample_size(draws, chain_dim=0, sample_dim=1).min())
    if draws.shape[0] == 1:
        half = draws.shape[1] // 2
        draws = torch.stack([draws[0, :half], draws[0, half : 2 * half]])
    return ess, float(split_gelman_rubin(draws, chain_dim=0, sample_dim=1).max())


def calibration(probs: Tensor, y: Tensor, bins: int = 15) -> dict:
    """Test NLL, ECE and accuracy of class probabilities ``probs`` (points, classes)."""
    probs = probs.double().clamp_min(1e-12)
    nll = float(-probs[torch.arange(len(y)), y].log().mean())
    confidence, predicted = probs.max(-1)
    correct = (predicted == y).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (confidence > lo) & (confidence <= hi)
        if in_bin.any():
            ece += float(in_bin.double().mean() * (correct[in_bin].mean() - confidence[in_bin].mean()).abs())
    return {"nll": round(nll, 4), "ece": round(ece, 4), "test_accuracy": round(float(correct.mean()), 4)}
