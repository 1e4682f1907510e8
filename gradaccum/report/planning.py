"""The memory planner's tables: the card table and its prediction against every training run's peak."""

from __future__ import annotations

from typing import Any

from gradaccum.report import rules
from gradaccum.report.findings import PlannerCheck
from gradaccum.report.results import fmt


def options_text(options: list[dict[str, Any]] | None) -> str:
    """The planner's options for one card: checkpointing or not, accum, predicted peak, the sweep's measured speed."""
    if options is None:
        return "-"
    if not options:
        return "none fits"
    return "; ".join(
        f"{'checkpointing, ' if o['checkpointing'] else ''}accum {o['accum']} (micro-batch "
        f"{o['micro_batch']}): {o['predicted_peak_mib']} MiB, {o['images_per_s']:.0f} images/s"
        for o in options
    )


def planner_card_rows(cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "card (GB)": c["card_gb"],
            "usable (MiB)": c["usable_mib"],
            "largest micro-batch": c["largest_micro_batch"],
            "smallest accum": fmt(c["smallest_accum"]),
            "micro-batch at that accum": fmt(c["micro_batch"]),
            "predicted peak (MiB)": fmt(c["predicted_peak_mib"]),
            "options that fit, fastest first": options_text(c.get("options")),
        }
        for c in cards
    ]


def planner_rows(checks: dict[str, PlannerCheck | str]) -> list[dict[str, Any]]:
    """Every variant: the planner's prediction for its micro-batch against its measured training peak
    (findings.planner_checks), or why there is none. A prediction under the measurement by more than the
    safety margin is flagged: that is the direction that ends in an out-of-memory error."""
    rows = []
    for name, c in checks.items():
        if isinstance(c, str):
            rows.append({"variant": name, "verdict": c})
            continue
        rows.append(
            {
                "variant": name,
                "micro-batch": c.micro_batch,
                "predicted (MiB)": fmt(c.predicted_mib, 0),
                "from": c.source,
                "measured (MiB)": fmt(c.measured_mib, 0),
                "predicted / measured": fmt(c.predicted_mib / c.measured_mib, 3),
                "verdict": planner_verdict(c),
            }
        )
    return rows


def planner_verdict(c: PlannerCheck) -> str:
    return {
        "under the margin": f"UNDER by {c.under:.1%}, more than the {c.margin:.0%} margin",
        "close": f"within {rules.CLOSE:.0%}",
        "under": f"under by {c.under:.1%}",
        "over": f"over by {-c.under:.1%}",
    }[c.verdict]
