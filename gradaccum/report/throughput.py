"""The speed stage's interleaved rounds as a table, and the verdict on each ratio."""

from __future__ import annotations

from typing import Any

from gradaccum.report.findings import Findings, SpeedRatio
from gradaccum.report.results import fmt


def speed_rows(f: Findings, speed: dict[str, Any]) -> list[dict[str, Any]]:
    """The interleaved measurement per variant: images/s per round, its median, and the ratio to the control."""
    ratios, reference = f.speed, f.roles.norm_control
    rows = []
    for name, row in speed["variants"].items():
        rounds = row.get("images_per_s") or []
        twin = f" (timed as {row['same_step_as']}: the same step, another lr)" if "same_step_as" in row else ""
        rows.append(
            {
                "variant": name + twin,
                "accum x micro-batch": f"{row['accum']} x {row['micro_batch']}" if "accum" in row else "-",
                "images/s per round": ", ".join(f"{x:.1f}" for x in rounds)
                or row.get("not_run")
                or row.get("did_not_fit", "-"),
                "median images/s": fmt(row.get("median_images_per_s"), 1),
                f"vs {reference}: median (range)": ratio_text(ratios.get(name)),
                "verdict": speed_verdict(ratios[name]) if name in ratios and name != reference else "-",
            }
        )
    return rows


def ratio_text(r: SpeedRatio | None) -> str:
    """An interleaved speed ratio: the median over rounds, then its range."""
    return f"{r.median:.2f} ({r.min:.2f} to {r.max:.2f})" if r else "-"


def speed_verdict(r: SpeedRatio) -> str:
    """Faster or slower only where every round agrees, with the sign test's p so a reader can weigh it."""
    if r.agreed:
        chance = ": could be chance" if r.could_be_chance else ""
        return f"{r.agreed} in all {r.rounds} rounds (sign test p = {r.p:.2g}{chance})"
    return f"not resolved: faster in {r.faster} of {r.rounds} rounds, slower in {r.slower}"
