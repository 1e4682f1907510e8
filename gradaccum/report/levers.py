"""The memory levers side by side against the norm control."""

from __future__ import annotations

from typing import Any

from gradaccum.report.findings import Findings
from gradaccum.report.results import fmt, peak_mib, seed_text
from gradaccum.report.throughput import ratio_text, speed_verdict


def lever_table(f: Findings) -> list[dict[str, Any]]:
    """Each memory lever against the norm control (same norm, lr and batch, none of the levers); speed
    from the interleaved measurement only."""
    ref, ratios = f.role("norm_control"), f.speed
    if not ref:
        return []
    rows, against = [], f"vs {f.roles.norm_control}"
    for name, lever in f.roles.levers.items():
        m = f.done.get(name)
        if m is None:
            if name in f.results:  # not run, or did not fit: say so in the lever's row
                rows.append(
                    {"lever": lever, "variant": name, f"peak memory {against}": f.results[name].record.why_not()}
                )
            continue
        rows.append(
            {
                "lever": lever + (f" ({m.amp} instead of {ref.amp})" if m.amp != ref.amp else ""),
                "variant": name,
                f"peak memory {against}": fmt(peak_mib(m) / peak_mib(ref), 2),
                "memory saved (MiB)": fmt(peak_mib(ref) - peak_mib(m), 0),
                f"throughput {against}, interleaved: median (range)": ratio_text(ratios.get(name)),
                "speed verdict": speed_verdict(ratios[name]) if name in ratios else "-",
                "final train loss": seed_text(m, "final_train_loss"),
                "test accuracy": seed_text(m, "test_accuracy"),
            }
        )
    return rows
