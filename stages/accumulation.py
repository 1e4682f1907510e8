"""Exact gradient accumulation: which samples each micro-batch holds, and what its loss weighs.

An optimizer step must see the gradient of the mean loss over its whole window of samples.
Each micro-batch's mean loss is weighted by its share of the window's samples, so a short last
micro-batch or a short last window counts exactly; dividing by `accum` (the tutorial) does not.
Windows never cross an epoch boundary, so no gradient leaks into the next epoch's first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MicroBatch:
    start: int
    stop: int
    weight: float  # (stop - start) / samples in its window


def micro_batch_size(batch: int, accum: int) -> int:
    """ceil(batch / accum): any accum from 1 to batch works, divisor or not."""
    if not 1 <= accum <= batch:
        raise ValueError(f"accum must be from 1 to the batch size {batch}, got {accum}")
    return math.ceil(batch / accum)


def windows(n: int, micro: int, accum: int) -> list[list[MicroBatch]]:
    """Split n samples into micro-batches of `micro`, grouped `accum` to an optimizer step."""
    bounds = [(s, min(s + micro, n)) for s in range(0, n, micro)]
    groups = [bounds[i : i + accum] for i in range(0, len(bounds), accum)]
    result = []
    for group in groups:
        samples = group[-1][1] - group[0][0]
        result.append([MicroBatch(a, b, (b - a) / samples) for a, b in group])
    return result


def steps_per_epoch(n: int, micro: int, accum: int) -> int:
    return math.ceil(math.ceil(n / micro) / accum)


def accumulated_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, accum: int) -> torch.Tensor:
    """The gradient one optimizer step would see for batch (x, y) split into `accum` micro-batches.

    Flattened into one vector, so two ways of computing it can be compared with one norm.
    """
    model.zero_grad(set_to_none=True)
    for mb in windows(len(y), micro_batch_size(len(y), accum), accum)[0]:
        loss = F.cross_entropy(model(x[mb.start : mb.stop]), y[mb.start : mb.stop])
        (loss * mb.weight).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grad


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 so the comparison adds no rounding of its own."""
    return float((a.double() - b.double()).norm() / b.double().norm())
