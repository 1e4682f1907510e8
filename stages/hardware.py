"""Stage `hardware` (always runs): which device and scale this checkout trains on.

Its output changes only when the machine does, so moving a checkout from a laptop to a GPU
re-runs training while a second `dvc repro` on the same machine stays cached.
"""

from __future__ import annotations

import torch

from gradaccum import mnist, models, params
from gradaccum.machine import describe, unusable_gpu
from gradaccum.outputs import write_json
from gradaccum.records import FORMAT, Hardware
from gradaccum.refusal import BadInput, refusing
from gradaccum.spec import check_distributed
from stages.paths import HARDWARE


def main() -> None:
    p = params.load()
    models.check_input(p.model)  # first in every run: a model that cannot take the images, in seconds
    cuda = torch.cuda.is_available()
    if not cuda and p.scale != "cpu" and (why := unusable_gpu()):  # not the CPU scale in silence on a GPU host
        raise BadInput(why)
    info = {"format": FORMAT} | describe(cuda)
    info["scale"] = params.resolve_scale(p, cuda)
    # here, before any long stage: more processes than GPUs, SyncBatchNorm on a CPU
    check_distributed(p, Hardware.model_validate(info))
    scale = p.scale_settings(info["scale"])  # the batches against the scale's images; the data's own count: sweep
    mnist.check_batch(info["scale"], scale.batch, scale.train_samples, steps=p.speed.steps)
    write_json(HARDWARE, info)
    where = info["gpu"]["name"] if cuda else info["cpu"]["name"]
    print(f"hardware: {info['device']} ({where}); scale: {info['scale']}")


if __name__ == "__main__":
    refusing(main)
