"""Stage `gradcheck`: is the accumulated gradient the large-batch gradient?

On one fixed batch, ||g_accum - g_full|| / ||g_full|| for several accum values (divisors and
not), with GroupNorm (per-sample, so equal up to float32 rounding) and BatchNorm (normalizes
each micro-batch by its own statistics, so it differs). GroupNorm also with the tutorial's
weighting (loss / accum): equal while every micro-batch is full, off when the last one is short
(accum 7: micro-batches of 14, the last 12). Float32 throughout, TF32 off.
"""

from __future__ import annotations

import sys

import torch

from stages import mnist, params
from stages.accumulation import accumulated_gradient, micro_batch_size, relative_difference
from stages.loop import normalize
from stages.models import build_model
from stages.outputs import read_json, write_json, write_table
from stages.paths import DATASET, GRADCHECK, GRADCHECK_TSV, HARDWARE

BATCH = 96  # 7 does not divide it: micro-batches of 14, the last one 12
ACCUMS = (1, 2, 3, 4, 7)
TOLERANCE = 1e-5  # float32 rounding over a few million summed terms


def main() -> None:
    p = params.load()
    device = torch.device(read_json(HARDWARE)["device"])
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    arrays = mnist.load(DATASET)
    x = normalize(torch.from_numpy(arrays["train_x"][:BATCH]).to(device))
    y = torch.from_numpy(arrays["train_y"][:BATCH]).long().to(device)
    rows = []
    for norm, weighting in (("group", "exact"), ("batch", "exact"), ("group", "divide")):
        model = build_model(**p["model"], norm=norm, seed=p["seed"]).to(device).train()
        full = accumulated_gradient(model, x, y, 1)
        for accum in ACCUMS:
            diff = relative_difference(accumulated_gradient(model, x, y, accum, weighting), full)
            rows.append(
                {
                    "norm": norm,
                    "weighting": weighting,
                    "accum": accum,
                    "micro_batch": micro_batch_size(BATCH, accum),
                    "relative_difference": diff,
                }
            )
            print(
                f"gradcheck: {norm}norm, {weighting} weighting, accum {accum}: "
                f"||g_accum - g_full|| / ||g_full|| = {diff:.3e}"
            )

    def diffs(norm: str, weighting: str) -> list[float]:
        return [r["relative_difference"] for r in rows if (r["norm"], r["weighting"]) == (norm, weighting)]

    group, batch, divide = diffs("group", "exact"), diffs("batch", "exact")[1:], diffs("group", "divide")
    write_table(GRADCHECK_TSV, rows, ("norm", "weighting", "accum", "micro_batch", "relative_difference"))
    write_json(
        GRADCHECK,
        {
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
        },
    )


if __name__ == "__main__":
    try:
        main()
    except params.ParamsError as err:
        sys.exit(f"error: {err}")
