"""Stage `speed`: every variant's optimizer steps, interleaved in rounds (see gradaccum/speed.py).

The report takes every speed comparison from here: the training stages run one after another.
"""

from __future__ import annotations

import torch

from gradaccum import mnist, models, params
from gradaccum.machine import process_seconds
from gradaccum.refusal import refusing
from gradaccum.spec import resolve
from gradaccum.speed import time_variants
from stages.paths import DATASET, SPEED, hardware, sweep_plan, write_record


def main() -> None:
    p = params.load()
    hw, plan = hardware(), sweep_plan()
    models.check_input(p.model)  # the checks that apply here, for a run of this stage alone
    specs = [resolve(p, variant, hw, plan) for variant in p.variants]  # one process: world size 1
    batch = specs[0].batch
    mnist.check_batch(hw.scale, batch, specs[0].train_samples, DATASET, steps=p.speed.steps)
    data = mnist.load_tensors(DATASET, torch.device(hw.device), p.speed.steps * batch, 0)
    result = time_variants(specs, data, p.speed.rounds, p.speed.steps)
    write_record(SPEED, result | {"stage_seconds": process_seconds()})
    for name, row in result["variants"].items():
        print(f"speed@{name}: {row.get('median_images_per_s') or row.get('not_run') or row.get('did_not_fit')}")


if __name__ == "__main__":
    refusing(main)
