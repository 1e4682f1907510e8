"""channels_last against PyTorch's default layout for the CPU training loop, interleaved (not yet switched on).

    python -m benchmarks.layout [--repeats 6]

The real loop (`train_epoch`) on 512 of the packed digits (data/dataset.npz, from `make repro`),
GroupNorm, float32, at the CPU scale's two shapes: 4 x 64 (the accumulation variants) and 1 x 256.
The two layouts alternate run by run, so the machine's drift hits both alike; prints the median
speeds and every pair's ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gradaccum import mnist, params
from gradaccum.accumulation import schedule
from gradaccum.loop import make_optimizer, make_scaler, train_epoch
from gradaccum.models import build_model

IMAGES = 512


def compare(p: params.Params, images: torch.Tensor, labels: torch.Tensor, micro: int, accum: int, repeats: int) -> str:
    arms = {}
    for channels_last in (False, True):
        model = build_model(**p.model.model_dump(), norm="group", seed=p.seed)
        model = model.to(memory_format=torch.channels_last) if channels_last else model
        arms[channels_last] = (model, make_optimizer(model, 3e-4), make_scaler(torch.device("cpu"), None))
    plan = schedule(IMAGES, micro, accum)

    def run(channels_last: bool) -> float:
        start = time.perf_counter()
        train_epoch(*arms[channels_last], images, labels, torch.arange(IMAGES), plan, None)
        return time.perf_counter() - start

    run(False), run(True)  # warm-up
    pairs = [(run(False), run(True)) for _ in range(repeats)]
    default, nhwc = (statistics.median(t) for t in zip(*pairs, strict=True))
    ratios = ", ".join(f"{a / b:.2f}" for a, b in pairs)
    return (
        f"{accum} x {micro}: default {IMAGES / default:.0f} images/s, channels_last {IMAGES / nhwc:.0f} images/s, "
        f"ratio {default / nhwc:.2f} (pairs: {ratios})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--data", type=Path, default=Path("data/dataset.npz"))
    args = parser.parse_args()
    arrays = mnist.load(args.data)
    images = torch.from_numpy(arrays["train_x"][:IMAGES])
    labels = torch.from_numpy(arrays["train_y"][:IMAGES]).long()
    for micro, accum in ((64, 4), (256, 1)):
        print(compare(params.load(), images, labels, micro, accum, args.repeats), flush=True)


if __name__ == "__main__":
    main()
