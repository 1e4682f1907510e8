"""The CPU model's convolutions, interleaved: timm's as they are, depthwise as matrix products, channels_last.

    python -m benchmarks.convolutions [--repeats 6]

The real loop (`train_epoch`) on 512 of the packed digits (data/dataset.npz, from `make repro`),
GroupNorm, float32, at the CPU scale's two shapes: 4 x 64 (the accumulation variants) and 1 x 256.
Three arms of the same model alternate run by run, so the machine's drift hits all alike:
timm's convolutions (oneDNN), the depthwise ones on small maps as matrix products
(gradaccum/depthwise.py, what the study runs on a CPU), and timm's in the channels_last layout.
Prints the median speeds and each arm's ratio to timm's, with every round's ratio; then the same under
bfloat16 autocast (the groupnorm_precision variant on a CPU), where the matrices take bfloat16 operands.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gradaccum import mnist, params
from gradaccum.accumulation import schedule
from gradaccum.loop import Learner, make_optimizer, make_scaler, train_epoch
from gradaccum.models import build_model

IMAGES = 512
ARMS = ("timm", "matmul depthwise", "channels_last")


def compare(
    p: params.Params,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro: int,
    accum: int,
    repeats: int,
    dtype: torch.dtype | None = None,
) -> str:
    arms = {}
    for arm in ARMS:
        model = build_model(p.model, "group", p.seed, matmul_depthwise=arm == ARMS[1])
        model = model.to(memory_format=torch.channels_last) if arm == "channels_last" else model
        arms[arm] = Learner(model, make_optimizer(model, 3e-4), make_scaler(torch.device("cpu"), dtype), dtype)
    batches = schedule(IMAGES, micro, accum)

    def run(arm: str) -> float:
        start = time.perf_counter()
        train_epoch(arms[arm], images, labels, torch.arange(IMAGES), batches)
        return time.perf_counter() - start

    for arm in ARMS:
        run(arm)  # warm-up
    rounds = [{arm: run(arm) for arm in ARMS} for _ in range(repeats)]
    median = {arm: statistics.median(r[arm] for r in rounds) for arm in ARMS}
    parts = [f"{str(dtype or torch.float32)[6:]}, {accum} x {micro}: timm {IMAGES / median['timm']:.0f} images/s"]
    for arm in ARMS[1:]:
        each = ", ".join(f"{r['timm'] / r[arm]:.2f}" for r in rounds)
        parts.append(f"{arm} {IMAGES / median[arm]:.0f} images/s, {median['timm'] / median[arm]:.2f}x ({each})")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--data", type=Path, default=Path("data/dataset.npz"))
    args = parser.parse_args()
    arrays = mnist.load(args.data)
    images = torch.from_numpy(arrays["train_x"][:IMAGES])
    labels = torch.from_numpy(arrays["train_y"][:IMAGES]).long()
    for dtype in (None, torch.bfloat16):  # float32; the precision lever's autocast
        for micro, accum in ((64, 4), (256, 1)):
            print(compare(params.load(), images, labels, micro, accum, args.repeats, dtype), flush=True)


if __name__ == "__main__":
    main()
