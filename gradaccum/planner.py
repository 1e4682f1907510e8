"""The memory planner: peak memory against the micro-batch, a line through the sweep's measured points.

From a line (records.Line): for an effective batch and a card size, the largest micro-batch and smallest
`accum` that fit. The line is only as good as the sweep's points; the report shows both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gradaccum.accumulation import accum_for, micro_batch_size
from gradaccum.records import Line, Plan

GIB_MIB = 1024  # card sizes are in GB as vendors and nvidia-smi's MiB/1024 use them
Speeds = dict[bool, tuple[list[int], list[float]]]  # checkpointing -> the sweep's measured images/s by micro-batch


def line_through_points(micro_batches: Sequence[int], peaks_mib: Sequence[float]) -> Line:
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
    return Line(
        fixed_mib=float(fixed),
        per_sample_mib=float(per_sample),
        r2=1.0 - ss_res / ss_tot if ss_tot else 1.0,  # of the line
        points=[(int(m), float(peak)) for m, peak in zip(x[order], peaks, strict=True)],
    )


def predict_mib(line: Line, micro: int) -> float:
    """The measured points joined, the line's slope beyond them; a line without points is the line itself."""
    slope, points = line.per_sample_mib, line.points
    if not points:
        return line.fixed_mib + slope * micro
    (first_x, first_y), (last_x, last_y) = points[0], points[-1]
    if micro < first_x:
        return first_y - slope * (first_x - micro)
    if micro > last_x:
        return last_y + slope * (micro - last_x)
    return float(np.interp(micro, [m for m, _ in points], [peak for _, peak in points]))


def largest_micro_batch(line: Line, budget_mib: float, batch: int) -> int:
    """0 when even one sample does not fit (the fixed part alone exceeds the budget)."""
    if line.per_sample_mib <= 0:
        return batch if predict_mib(line, 1) <= budget_mib else 0
    low, high = 0, batch  # the prediction grows with the micro-batch: bisect for the last that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if predict_mib(line, mid) <= budget_mib else (low, mid - 1)
    return low


def usable_mib(memory_mib: float, margin: float) -> float:
    """What a device leaves a step: its memory less the safety margin (params.yaml's memory.safety_margin)."""
    return memory_mib * (1 - margin)


def card_usable_mib(card_gb: float, margin: float) -> float:
    """`usable_mib` of a card given in GB, as vendors and nvidia-smi's MiB / 1024 give it."""
    return usable_mib(card_gb * GIB_MIB, margin)


def smallest_accum_by_line(line: Line, budget_mib: float, batch: int) -> int | None:
    """The fewest micro-batches per step whose micro-batch the line predicts to fit; None if none does.
    (gradaccum.fit's engine proposes with this, then replays the step on the card itself.)"""
    largest = largest_micro_batch(line, budget_mib, batch)
    return accum_for(batch, largest) if largest >= 1 else None


def options(lines: dict[bool, Line], speeds: Speeds, budget_mib: float, batch: int) -> list[dict[str, Any]]:
    """With activation checkpointing off and on, the fewest micro-batches whose micro-batch fits.

    `speeds` holds the sweep's measured images/s against micro-batch for each; an option's speed is read
    off them at its micro-batch (linear between measured points), fastest first. At the same accum the
    plain option comes first whatever the sweep timed: checkpointing does the plain step's work and
    recomputes the forward on top, and a sweep point's speed is one short run that a stall of the machine
    can reverse (it did in the CPU reference at db424f3: 392 against 500 images/s at micro-batch 256).
    """
    rows = []
    for checkpointing, line in lines.items():
        accum = smallest_accum_by_line(line, budget_mib, batch)
        if accum is None:
            continue
        micro = micro_batch_size(batch, accum)
        measured_micro, measured_speed = speeds[checkpointing]
        rows.append(
            {
                "checkpointing": checkpointing,
                "accum": accum,
                "micro_batch": micro,
                "predicted_peak_mib": round(predict_mib(line, micro)),
                "images_per_s": round(float(np.interp(micro, measured_micro, measured_speed)), 1),
            }
        )
    same_accum = len({r["accum"] for r in rows}) == 1
    return sorted(rows, key=lambda r: (same_accum and r["checkpointing"], -r["images_per_s"]))


def card_table(
    line: Line,
    batch: int,
    cards_gb: Sequence[float],
    margin: float,
    lines: dict[bool, Line] | None = None,
    speeds: Speeds | None = None,
) -> list[dict[str, Any]]:
    """Per card: the plain line's largest micro-batch and smallest accum, and with `lines`, both options."""
    rows = []
    for card in cards_gb:
        budget = card_usable_mib(card, margin)
        accum = smallest_accum_by_line(line, budget, batch)
        row = {
            "card_gb": card,
            "usable_mib": round(budget),
            "largest_micro_batch": largest_micro_batch(line, budget, batch),
            "smallest_accum": accum,
            "micro_batch": micro_batch_size(batch, accum) if accum else None,
            "predicted_peak_mib": round(predict_mib(line, micro_batch_size(batch, accum))) if accum else None,
        }
        if lines and speeds:
            row["options"] = options(lines, speeds, budget, batch)  # fastest first
        rows.append(row)
    return rows


def measured_speeds(plan: Plan) -> Speeds:
    """The sweep's measured images/s against micro-batch (sorted), with checkpointing off and on."""
    speeds = {}
    for checkpointing in (False, True):
        points = sorted(
            (p["micro_batch"], p["images_per_s"])
            for p in plan.points
            if p["fit"] and p["checkpointing"] == checkpointing
        )
        speeds[checkpointing] = ([m for m, _ in points], [s for _, s in points])
    return speeds


def cards_for(plan: Plan, cards_gb: Sequence[float], margin: float) -> list[dict[str, Any]]:
    """The card table for the sweep's plan: built by the report, so card sizes re-run the report only."""
    return card_table(plan.line, plan.batch, cards_gb, margin, plan.lines, measured_speeds(plan))


def this_machine_options(plan: Plan) -> list[dict[str, Any]]:
    """The options that fit this machine's memory (less the safety margin the sweep used), fastest first."""
    machine = plan.this_machine
    budget = usable_mib(machine.memory_mib, machine.safety_margin)
    return options(plan.lines, measured_speeds(plan), budget, plan.batch)
