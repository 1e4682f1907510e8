"""The memory planner: peak memory = fixed + per_sample x micro-batch, fitted on measured points.

From the fit: for an effective batch and a card size, the largest micro-batch and smallest
`accum` that fit. The fit is only as good as the sweep's points; the report shows both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gradaccum.accumulation import micro_batch_size

GIB_MIB = 1024  # card sizes are in GB as vendors and nvidia-smi's MiB/1024 use them
LEVERS = {"accumulation": False, "checkpointing": True}  # the sweep's two lines: activation checkpointing off, on


def fit(micro_batches: Sequence[int], peaks_mib: Sequence[float]) -> dict[str, Any]:
    """The sweep's measured points, and the least-squares line through them for beyond their range.

    Between two measured micro-batches the prediction joins their peaks; outside, it continues from the
    nearest point with the line's slope. A line alone lies under part of a bent curve, the direction that
    ends in an out-of-memory error: with activation checkpointing on the CPU the peak grew 1.43 MiB per
    sample from 64 to 256 and 0.88 from 256 to 512 (measured), and the line fell 3% below the middle one.
    Peaks are kept non-decreasing (a noisy smaller point never lowers a larger one's prediction).
    Needs two distinct micro-batch sizes.
    """
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
    order = np.argsort(x, kind="stable")
    peaks = np.maximum.accumulate(y[order])
    return {
        "fixed_mib": float(fixed),
        "per_sample_mib": float(per_sample),
        "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0,  # of the line
        "points": [[int(m), float(peak)] for m, peak in zip(x[order], peaks, strict=True)],
    }


def predict_mib(model: dict[str, Any], micro: int) -> float:
    """The measured points joined, the line's slope beyond them; a model without points is the line."""
    slope, points = model["per_sample_mib"], model.get("points")
    if not points:
        return model["fixed_mib"] + slope * micro
    (first_x, first_y), (last_x, last_y) = points[0], points[-1]
    if micro < first_x:
        return first_y - slope * (first_x - micro)
    if micro > last_x:
        return last_y + slope * (micro - last_x)
    return float(np.interp(micro, [m for m, _ in points], [peak for _, peak in points]))


def largest_micro_batch(model: dict[str, Any], budget_mib: float, batch: int) -> int:
    """0 when even one sample does not fit (the fixed part alone exceeds the budget)."""
    if model["per_sample_mib"] <= 0:
        return batch if predict_mib(model, 1) <= budget_mib else 0
    low, high = 0, batch  # the prediction grows with the micro-batch: bisect for the last that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if predict_mib(model, mid) <= budget_mib else (low, mid - 1)
    return low


def smallest_accum(model: dict[str, float], budget_mib: float, batch: int) -> int | None:
    """The fewest micro-batches per step whose micro-batch, ceil(batch / accum), fits; None if none does."""
    largest = largest_micro_batch(model, budget_mib, batch)
    if largest < 1:
        return None
    accum = math.ceil(batch / largest)
    while micro_batch_size(batch, accum) > largest:  # ceil rounding can push the micro-batch one over
        accum += 1
    return accum


def options(
    fits: dict[str, dict[str, float]], speeds: dict[str, tuple[list[int], list[float]]], budget_mib: float, batch: int
) -> list[dict[str, Any]]:
    """For each lever ("accumulation", "checkpointing"), the fewest micro-batches whose micro-batch fits.

    `speeds` holds the sweep's measured images/s against micro-batch for each lever; an option's speed
    is read off them at its micro-batch (linear between measured points), fastest first. At the same accum
    the plain option comes first whatever the sweep timed: checkpointing does the plain step's work and
    recomputes the forward on top, and a sweep point's speed is one short run that a stall of the machine
    can reverse (it did in the CPU reference at db424f3: 392 against 500 images/s at micro-batch 256).
    """
    rows = []
    for lever, model in fits.items():
        accum = smallest_accum(model, budget_mib, batch)
        if accum is None:
            continue
        micro = micro_batch_size(batch, accum)
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
    same_accum = len({r["accum"] for r in rows}) == 1
    return sorted(rows, key=lambda r: (same_accum and r["lever"] == "checkpointing", -r["images_per_s"]))


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
            "micro_batch": micro_batch_size(batch, accum) if accum else None,
            "predicted_peak_mib": round(predict_mib(model, micro_batch_size(batch, accum))) if accum else None,
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
