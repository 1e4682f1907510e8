"""The memory planner: peak memory = fixed + per_sample x micro-batch, fitted on measured points.

From the fit: for an effective batch and a card size, the largest micro-batch and smallest
`accum` that fit. The fit is only as good as the sweep's points; the report shows both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

GIB_MIB = 1024  # card sizes are in GB as vendors and nvidia-smi's MiB/1024 use them
LEVERS = {"accumulation": False, "checkpointing": True}  # the sweep's two lines: activation checkpointing off, on


def fit(micro_batches: Sequence[int], peaks_mib: Sequence[float]) -> dict[str, float]:
    """Least-squares line through (micro-batch, peak MiB); needs two distinct micro-batch sizes."""
    x = np.asarray(micro_batches, dtype=float)
    y = np.asarray(peaks_mib, dtype=float)
    if len(set(x.tolist())) < 2:
        raise ValueError(
            f"the fit needs peaks at two or more distinct micro-batch sizes, got {sorted(set(x.tolist()))}"
        )
    per_sample, fixed = np.polyfit(x, y, 1)
    predicted = fixed + per_sample * x
    ss_res = float(((y - predicted) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {
        "fixed_mib": float(fixed),
        "per_sample_mib": float(per_sample),
        "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0,
    }


def predict_mib(model: dict[str, float], micro: int) -> float:
    return model["fixed_mib"] + model["per_sample_mib"] * micro


def largest_micro_batch(model: dict[str, float], budget_mib: float, batch: int) -> int:
    """0 when even one sample does not fit (the fixed part alone exceeds the budget)."""
    if model["per_sample_mib"] <= 0:
        return batch if model["fixed_mib"] <= budget_mib else 0
    return max(0, min(batch, math.floor((budget_mib - model["fixed_mib"]) / model["per_sample_mib"])))


def smallest_accum(model: dict[str, float], budget_mib: float, batch: int) -> int | None:
    """The fewest micro-batches per step whose micro-batch, ceil(batch / accum), fits; None if none does."""
    largest = largest_micro_batch(model, budget_mib, batch)
    if largest < 1:
        return None
    accum = math.ceil(batch / largest)
    while math.ceil(batch / accum) > largest:  # ceil rounding can push the micro-batch one over
        accum += 1
    return accum


def options(
    fits: dict[str, dict[str, float]], speeds: dict[str, tuple[list[int], list[float]]], budget_mib: float, batch: int
) -> list[dict[str, Any]]:
    """For each lever ("accumulation", "checkpointing"), the fewest micro-batches whose micro-batch fits.

    `speeds` holds the sweep's measured images/s against micro-batch for each lever; an option's speed
    is read off them at its micro-batch (linear between measured points), fastest first.
    """
    rows = []
    for lever, model in fits.items():
        accum = smallest_accum(model, budget_mib, batch)
        if accum is None:
            continue
        micro = math.ceil(batch / accum)
        measured_micro, measured_speed = speeds[lever]
        rows.append(
            {
                "lever": lever,
                "accum": accum,
                "micro_batch": micro,
                "predicted_peak_mib": round(predict_mib(model, micro)),
                "images_per_s": round(float(np.interp(micro, measured_micro, measured_speed)), 1),
            }
        )
    return sorted(rows, key=lambda r: -r["images_per_s"])


def card_table(
    model: dict[str, float],
    batch: int,
    cards_gb: Sequence[float],
    margin: float,
    fits: dict[str, dict[str, float]] | None = None,
    speeds: dict[str, tuple[list[int], list[float]]] | None = None,
) -> list[dict[str, Any]]:
    """Per card: the plain fit's largest micro-batch and smallest accum, and with `fits`, every lever's option."""
    rows = []
    for card in cards_gb:
        budget = card * GIB_MIB * (1 - margin)
        accum = smallest_accum(model, budget, batch)
        row = {
            "card_gb": card,
            "usable_mib": round(budget),
            "largest_micro_batch": largest_micro_batch(model, budget, batch),
            "smallest_accum": accum,
            "micro_batch": math.ceil(batch / accum) if accum else None,
            "predicted_peak_mib": round(predict_mib(model, math.ceil(batch / accum))) if accum else None,
        }
        if fits and speeds:
            row["options"] = options(fits, speeds, budget, batch)  # fastest first
        rows.append(row)
    return rows


def levers(plan: dict[str, Any]) -> tuple[dict[str, dict[str, float]], dict[str, tuple[list[int], list[float]]]]:
    """From the sweep's result: each lever's fit, and its measured images/s against micro-batch (sorted)."""
    fits = {"accumulation": plan["fit"], "checkpointing": plan["fit_checkpointing"]}
    speeds = {}
    for lever, checkpointing in LEVERS.items():
        points = sorted(
            (p["micro_batch"], p["images_per_s"])
            for p in plan["points"]
            if p["fit"] and p["checkpointing"] == checkpointing
        )
        speeds[lever] = ([m for m, _ in points], [s for _, s in points])
    return fits, speeds


def cards_for(plan: dict[str, Any], cards_gb: Sequence[float], margin: float) -> list[dict[str, Any]]:
    """The card table for the sweep's result: built by the report, so card sizes re-run the report only."""
    fits, speeds = levers(plan)
    return card_table(plan["fit"], plan["batch"], cards_gb, margin, fits, speeds)


def this_machine_options(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The options that fit this machine's memory (less the safety margin the sweep used), fastest first."""
    fits, speeds = levers(plan)
    machine = plan["this_machine"]
    return options(fits, speeds, machine["memory_mib"] * (1 - machine["safety_margin"]), plan["batch"])
