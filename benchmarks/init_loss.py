"""Why every variant's first loss is near 5, not ln 10 = 2.30: the classifier's scale at initialisation.

    python -m benchmarks.init_loss [--images 256]

The study's model as the train stage builds it (seed 99, both norms), on the first packed training images
(data/dataset.npz, from `make repro`), in training mode as the loop's first step sees it; its classifier as timm
initialises it (efficientnet's `_init_weight_goog`: uniform within 1/sqrt(fan_in + fan_out), with fan_in taken as 0,
so 1/sqrt(10) for 10 classes), as PyTorch's nn.Linear would (reset_parameters), and zeroed (loss exactly ln 10).
Prints the head's weight spread, the logits' and the loss for each. Changes nothing in the study's models.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import mnist, params
from gradaccum.loop import normalize
from gradaccum.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--data", type=Path, default=Path("data/dataset.npz"))
    args = parser.parse_args()
    p = params.load()
    data = mnist.load(args.data, ("train_x", "train_y"))
    x = normalize(torch.from_numpy(data["train_x"][: args.images].copy()))
    y = torch.from_numpy(data["train_y"][: args.images].copy()).long()
    print(f"ln {p.model.num_classes} = {math.log(p.model.num_classes):.3f}; {args.images} images, training mode")
    for norm in ("batch", "group"):
        for init in ("timm", "pytorch", "zero"):
            model = build_model(p.model, norm, p.seed)
            head = model.get_classifier()
            if init == "pytorch":
                torch.manual_seed(p.seed)
                head.reset_parameters()
            elif init == "zero":
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)
            with torch.no_grad():
                logits = model.train()(x)
            print(
                f"{norm}norm, {init:7s} head: weight std {head.weight.std():.4f}, logits std {logits.std():.3f}, "
                f"loss {F.cross_entropy(logits, y):.3f}"
            )


if __name__ == "__main__":
    main()
