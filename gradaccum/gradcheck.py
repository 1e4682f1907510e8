"""Is the accumulated gradient the large-batch gradient? Measured through the training loop itself.

The loop that trains (gradaccum/loop.py, `train_epoch`) runs an epoch of SAMPLES shuffled samples (a full
window of BATCH and a short last one, as an epoch ends), micro-batches of ceil(BATCH / accum), accum to a
window as training splits them, under a stand-in
optimizer that records every window's gradient instead of stepping; each is held against the gradient of
the mean loss over the same samples in one pass: ||g_accum - g_full|| / ||g_full||, the larger over the
windows, for several accum values (divisors and not). GroupNorm is per-sample, so equal up to float32 rounding;
BatchNorm normalizes each micro-batch by its own statistics, so it differs. GroupNorm also with the
tutorial's weighting (loss / accum), the epoch-end step kept: exact while every micro-batch and window is full,
off where one is short (accum 7: micro-batches of 14, windows of 98 and 22 samples, the last micro-batch 8;
accum 4: the last window one micro-batch of 24, weighed 1/4). Float32 throughout, TF32 off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.accumulation import micro_batch_size, relative_difference, schedule, windows
from gradaccum.experiment import variant_model
from gradaccum.loop import Learner, make_scaler, normalize, train_epoch
from gradaccum.spec import RunSpec

BATCH = 96  # 7 does not divide it: micro-batches of 14, a window of 98
SAMPLES = 120  # a full window and a short last one; which samples each holds depends on the shuffle
ACCUMS = (1, 2, 3, 4, 7)
TOLERANCE = 1e-5  # float32 rounding over a few million summed terms
COLUMNS = ("norm", "weighting", "accum", "micro_batch", "relative_difference")
METHODS = (("group", "exact"), ("batch", "exact"), ("group", "divide"))  # (norm, weighting)


class GradientRecorder(torch.optim.Optimizer):
    """A stand-in optimizer: `step` keeps a copy of the window's gradient, flattened, and changes no weight,
    so every window is differentiated at the same weights as the full-batch gradient it is held against."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.gradients: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad.flatten() for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.gradients.append(torch.cat(grads).clone())


def loop_gradients(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    perm: torch.Tensor,
    micro: int,
    accum: int,
    weighting: str = "exact",
) -> list[torch.Tensor]:
    """Each window's gradient as `train_epoch` accumulates it over `perm`'s order (float32, one process)."""
    recorder = GradientRecorder(model.parameters())
    batches = schedule(len(perm), micro, accum, weighting)
    train_epoch(Learner(model, recorder, make_scaler(images.device, None), None), images, labels, perm, batches)
    return recorder.gradients


def full_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over all of `images` in one forward and backward, flattened."""
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(normalize(images)), labels).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grad


def window_differences(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    perm: torch.Tensor,
    micro: int,
    accum: int,
    weighting: str = "exact",
    fulls: dict[tuple[int, int], torch.Tensor] | None = None,
) -> list[float]:
    """Per window of the loop's schedule: its accumulated gradient against the full-batch gradient of its samples;
    `fulls` keeps those by window, for the next call on the same model (accum 1 to 4 share their windows)."""
    fulls = {} if fulls is None else fulls
    got = loop_gradients(model, images, labels, perm, micro, accum, weighting)
    spans = [(w[0].start, w[-1].stop) for w in windows(len(perm), micro, accum)]
    for a, b in spans:
        if (a, b) not in fulls:
            fulls[a, b] = full_gradient(model, images[perm[a:b]], labels[perm[a:b]])
    # one optimizer step per window, or this fails
    return [relative_difference(g, fulls[span]) for g, span in zip(got, spans, strict=True)]


def divide_misweighs(n: int, micro: int, accum: int) -> bool:
    """Whether loss / accum gives some micro-batch of the epoch another weight than its share of its window:
    a short micro-batch, or a last window of fewer than accum micro-batches."""
    exact, divide = schedule(n, micro, accum), schedule(n, micro, accum, "divide")
    return any(abs(a.weight - b.weight) > 1e-12 for a, b in zip(exact, divide, strict=True))


def gradient_check(
    specs: dict[str, RunSpec], images: torch.Tensor, labels: torch.Tensor, log: Any = print
) -> dict[str, Any]:
    """Rows for every (norm, weighting, accum), the largest difference over the windows, and the verdicts;
    `specs[norm]`'s model, built afresh for each method from its seed, which also shuffles the first SAMPLES
    images. Float32 whatever the specs' precision: rounding must not hide a difference."""
    device = images.device
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    n = SAMPLES
    images, labels = images[:n], labels[:n].long()
    seed = specs["group"].seed
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
    rows, fulls = [], {norm: {} for norm, _ in METHODS}  # a norm's full-batch gradients: its models are the same
    for norm, weighting in METHODS:
        model = variant_model(specs[norm], seed, device)
        for accum in ACCUMS:
            micro = micro_batch_size(BATCH, accum)
            diff = max(window_differences(model, images, labels, perm, micro, accum, weighting, fulls[norm]))
            rows.append(dict(zip(COLUMNS, (norm, weighting, accum, micro, diff), strict=True)))
            log(
                f"gradcheck: {norm}norm, {weighting} weighting, accum {accum}: ||g_accum - g_full|| / ||g_full|| "
                f"= {diff:.3e} (the larger of a full and a short shuffled window)"
            )

    def diffs(norm: str, weighting: str) -> list[float]:
        return [r["relative_difference"] for r in rows if (r["norm"], r["weighting"]) == (norm, weighting)]

    group, batch, divide = diffs("group", "exact"), diffs("batch", "exact")[1:], diffs("group", "divide")
    return {
        "batch": BATCH,
        "samples": n,
        "windows": len(windows(n, BATCH, 1)),
        "through": "gradaccum.loop.train_epoch, shuffled, a recording stand-in for the optimizer",
        "device": device.type,
        "precision": "float32, TF32 off",
        "tolerance": TOLERANCE,
        "groupnorm_max": max(group),
        "groupnorm_equal": max(group) <= TOLERANCE,
        "batchnorm_min": min(batch),
        "batchnorm_differs": min(batch) > TOLERANCE,
        "tutorial_weighting_max": max(divide),  # GroupNorm, loss / accum: off where it misweighs a micro-batch
        "tutorial_weighting_short_accum": [a for a in ACCUMS if divide_misweighs(n, micro_batch_size(BATCH, a), a)],
        "rows": rows,
    }
