"""Exact gradient accumulation: which samples each micro-batch holds, and what its loss weighs.

An optimizer step must see the gradient of the mean loss over its whole window of samples.
Each micro-batch's mean loss is weighted by its share of the window's samples, so a short last
micro-batch or a short last window counts exactly; dividing by `accum` (the tutorial) does not.
Windows never cross an epoch boundary, so no gradient leaks into the next epoch's first step.
`schedule` can also reproduce the tutorial's loop as written, to measure what the corrections change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rule for the micro-batch is torch-free: the report and the planner use it too
    import torch

WEIGHTINGS = ("exact", "divide")  # exact: each micro-batch's share of its window; divide: 1 / accum (the tutorial)


@dataclass(frozen=True)
class MicroBatch:
    start: int
    stop: int
    weight: float  # what its mean loss is multiplied by: (stop - start) / samples in its window, when exact
    step: bool = False  # an optimizer step follows this micro-batch


def micro_batch_size(batch: int, accum: int) -> int:
    """ceil(batch / accum): any accum from 1 to batch works, divisor or not."""
    if not 1 <= accum <= batch:
        raise ValueError(f"accum must be from 1 to the batch size {batch}, got {accum}")
    return math.ceil(batch / accum)


def accum_for(batch: int, micro: int) -> int:
    """The fewest micro-batches of at most `micro` samples that make up `batch`: ceil(batch / micro), whose own
    micro-batch, ceil(batch / accum), is then never above `micro`. The inverse of `micro_batch_size`."""
    if micro < 1:
        raise ValueError(f"the micro-batch must be at least 1, got {micro}")
    return math.ceil(batch / min(micro, batch))


def fewest_for_micro(batch: int, accum: int) -> int:
    """The fewest micro-batches with `accum`'s micro-batch size (of 8, accum 5 to 7 share 4's size, 2)."""
    return accum_for(batch, micro_batch_size(batch, accum))


def next_accum(batch: int, accum: int) -> int:
    """The next accum up whose micro-batch is smaller (of 8: after 4, whose micro-batch is 2, comes 8)."""
    micro = micro_batch_size(batch, accum)
    return accum_for(batch, micro - 1) if micro > 1 else batch


def previous_accum(batch: int, accum: int) -> int:
    """The next accum down whose micro-batch is larger, the fewest of those (of 8: 8, then 4, 3, 2, 1)."""
    below = fewest_for_micro(batch, accum) - 1
    return fewest_for_micro(batch, below) if below >= 1 else 1


def windows(n: int, micro: int, accum: int) -> list[list[MicroBatch]]:
    """Split n samples into micro-batches of `micro`, grouped `accum` to an optimizer step."""
    bounds = [(s, min(s + micro, n)) for s in range(0, n, micro)]
    groups = [bounds[i : i + accum] for i in range(0, len(bounds), accum)]
    result = []
    for group in groups:
        samples = group[-1][1] - group[0][0]
        result.append([MicroBatch(a, b, (b - a) / samples, step=(a, b) == group[-1]) for a, b in group])
    return result


def schedule(
    n: int,
    micro: int,
    accum: int,
    weighting: str = "exact",
    epoch_end_step: bool = True,
    rank: int = 0,
    world: int = 1,
) -> list[MicroBatch]:
    """One epoch's micro-batches in order (this rank's), each with its loss weight and whether a step follows.

    The defaults are exact accumulation (`windows`, flattened). weighting="divide" with
    epoch_end_step=False is the tutorial's loop as written: `loss / accum`, a step when
    `(i + 1) % accum == 0`, and none at the epoch's end, so the last micro-batches' gradients are
    carried into the next epoch's first step (and the last epoch's are never applied).

    With world > 1 (DDP) a window holds accum x world micro-batches and rank r takes every world-th
    one, from the r-th. DDP averages the ranks' gradients, so exact weights are multiplied by world.
    A rank left without a micro-batch in a short last window runs one sample at weight 0: every rank
    must join the window's all-reduce.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    batches = []
    for window in windows(n, micro, accum * world):
        mine = window[rank::world] or [MicroBatch(window[0].start, window[0].start + 1, 0.0)]
        full = len(window) == accum * world
        for i, mb in enumerate(mine):
            weight = mb.weight * world if weighting == "exact" else (1 / accum if mb.weight else 0.0)
            step = i == len(mine) - 1 and (full or epoch_end_step)
            batches.append(MicroBatch(mb.start, mb.stop, weight, step))
    return batches


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 so the comparison adds no rounding of its own."""
    return float((a.double() - b.double()).norm() / b.double().norm())
