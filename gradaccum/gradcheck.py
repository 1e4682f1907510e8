"""Is the accumulated gradient the large-batch gradient?

On one fixed batch, ||g_accum - g_full|| / ||g_full|| for several accum values (divisors and
not), with GroupNorm (per-sample, so equal up to float32 rounding) and BatchNorm (normalizes
each micro-batch by its own statistics, so it differs). GroupNorm also with the tutorial's
weighting (loss / accum): equal while every micro-batch is full, off when the last one is short
(accum 7: micro-batches of 14, the last 12). Float32 throughout, TF32 off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.accumulation import accumulated_gradient, micro_batch_size, relative_difference
from gradaccum.loop import normalize

BATCH = 96  # 7 does not divide it: micro-batches of 14, the last one 12
ACCUMS = (1, 2, 3, 4, 7)
TOLERANCE = 1e-5  # float32 rounding over a few million summed terms
COLUMNS = ("norm", "weighting", "accum", "micro_batch", "relative_difference")
METHODS = (("group", "exact"), ("batch", "exact"), ("group", "divide"))  # (norm, weighting)


def gradient_check(
    build: Callable[[str], torch.nn.Module], images: torch.Tensor, labels: torch.Tensor, log: Any = print
) -> dict[str, Any]:
    """Rows for every (norm, weighting, accum) and the verdicts; `build(norm)` makes the same model each call."""
    device = images.device
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = normalize(images[:BATCH]), labels[:BATCH].long()
    rows = []
    for norm, weighting in METHODS:
        model = build(norm).train()
        full = accumulated_gradient(model, x, y, 1)
        for accum in ACCUMS:
            diff = relative_difference(accumulated_gradient(model, x, y, accum, weighting), full)
            rows.append(dict(zip(COLUMNS, (norm, weighting, accum, micro_batch_size(BATCH, accum), diff), strict=True)))
            log(
                f"gradcheck: {norm}norm, {weighting} weighting, accum {accum}: ||g_accum - g_full|| / ||g_full|| "
                f"= {diff:.3e}"
            )

    def diffs(norm: str, weighting: str) -> list[float]:
        return [r["relative_difference"] for r in rows if (r["norm"], r["weighting"]) == (norm, weighting)]

    group, batch, divide = diffs("group", "exact"), diffs("batch", "exact")[1:], diffs("group", "divide")
    return {
        "batch": BATCH,
        "device": device.type,
        "precision": "float32, TF32 off",
        "tolerance": TOLERANCE,
        "groupnorm_max": max(group),
        "groupnorm_equal": max(group) <= TOLERANCE,
        "batchnorm_min": min(batch),
        "batchnorm_differs": min(batch) > TOLERANCE,
        "tutorial_weighting_max": max(divide),  # GroupNorm, loss / accum: off only where a micro-batch is short
        "tutorial_weighting_short_accum": [
            r["accum"] for r in rows if r["weighting"] == "divide" and BATCH % r["micro_batch"] != 0
        ],
        "rows": rows,
    }
