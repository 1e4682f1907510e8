"""Stage `speed`: every variant's optimizer steps, interleaved in rounds (see gradaccum/speed.py).

The report takes every speed comparison from here: the training stages run one after another.
"""

from __future__ import annotations

import sys

import torch

from gradaccum import mnist, params
from gradaccum.machine import process_seconds
from gradaccum.outputs import read_json, write_json
from gradaccum.speed import time_variants
from stages.paths import DATASET, HARDWARE, SPEED, SWEEP_PLAN


def main() -> None:
    p = params.load()
    hw = read_json(HARDWARE)
    plan = read_json(SWEEP_PLAN) if SWEEP_PLAN.exists() else None
    scale = p.scale_settings(hw["scale"])
    n = p.speed.steps * scale.batch
    mnist.check_batch(DATASET, n, f"speed.steps x scales.{hw['scale']}.batch", scale.train_samples)
    data = mnist.load_tensors(DATASET, torch.device(hw["device"]), n, 0)
    result = time_variants(p, hw, data, plan, p.speed.rounds, p.speed.steps)
    write_json(SPEED, result | {"stage_seconds": process_seconds()})
    for name, row in result["variants"].items():
        print(f"speed@{name}: {row.get('median_images_per_s') or row.get('not_run') or row.get('did_not_fit')}")


if __name__ == "__main__":
    try:
        main()
    except (params.ParamsError, mnist.DataError) as err:
        sys.exit(f"error: {err}")
