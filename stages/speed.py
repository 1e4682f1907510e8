"""Stage `speed`: every variant's optimizer steps, interleaved in rounds (see gradaccum/speed.py).

The report takes every speed comparison from here: the training stages run one after another.
"""

from __future__ import annotations

import torch

from gradaccum import mnist, models, params
from gradaccum.machine import process_seconds
from gradaccum.outputs import write_json
from gradaccum.refusal import BadInput, refuse
from gradaccum.speed import time_variants
from stages.paths import DATASET, HARDWARE, SPEED, SWEEP_PLAN, read, read_if_there


def main() -> None:
    p = params.load()
    hw = read(HARDWARE)
    models.check_input(p.model)  # the checks that apply here, for a run of this stage alone
    plan = read_if_there(SWEEP_PLAN)
    scale = p.scale_settings(hw["scale"])
    mnist.check_batch(hw["scale"], scale.batch, scale.train_samples, DATASET, steps=p.speed.steps)
    n = p.speed.steps * scale.batch
    data = mnist.load_tensors(DATASET, torch.device(hw["device"]), n, 0)
    result = time_variants(p, hw, data, plan, p.speed.rounds, p.speed.steps)
    write_json(SPEED, result | {"stage_seconds": process_seconds()})
    for name, row in result["variants"].items():
        print(f"speed@{name}: {row.get('median_images_per_s') or row.get('not_run') or row.get('did_not_fit')}")


if __name__ == "__main__":
    try:
        main()
    except BadInput as err:
        refuse(err)
