"""The training loop, read in one screen: micro-batches weighted by their share of the window,
one optimizer step when a window is complete, GradScaler stepping only then.

Library code: the `train@<variant>` stage, the sweep, the gradient check and the benchmarks all
run this loop, so what they measure is what the study trains with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from gradaccum import distributed
from gradaccum.accumulation import MicroBatch, schedule

if TYPE_CHECKING:
    from gradaccum.spec import RunSpec

EPOCH_COLUMNS = (
    "epoch",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "optimizer_steps",
    "skipped_steps",
    "images_per_second",
    "seconds",
)
STEP_COLUMNS = ("step", "epoch", "train_loss")  # train_loss: the mean over the step's window (samples of this epoch)


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.01, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW, as the tutorial: the one optimizer every run of the loop uses (stages, sweep, benchmarks).

    `foreach=None` is PyTorch's choice for the parameters' device: its foreach kernels on a GPU, one tensor at a
    time on the CPU (torch.optim.optimizer._default_to_fused_or_foreach). The trace asks for foreach itself to step
    as a GPU would on its fake CPU tensors."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=foreach)


def make_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """A GradScaler that scales only under float16 autocast; elsewhere a pass-through with the same calls."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """ToTensor + Normalize((0.5,), (1.0,)) as the tutorial, on a whole uint8 batch at once."""
    return (images.float() / 255.0 - 0.5).unsqueeze(1)


@dataclass(frozen=True)
class Learner:
    """What the loop steps: the model, its optimizer, the GradScaler and the autocast dtype (None: float32)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    dtype: torch.dtype | None

    @classmethod
    def of(cls, model: nn.Module, spec: RunSpec, device: torch.device) -> Learner:
        """`model` with the spec's optimizer and precision, as every stage trains it."""
        opt, scaler = make_optimizer(model, spec.lr, spec.weight_decay), make_scaler(device, spec.dtype)
        return cls(model, opt, scaler, spec.dtype)


@dataclass(frozen=True)
class Epoch:
    """One epoch of the loop: its mean training loss over samples (every rank's), the optimizer steps, the steps
    the scaler skipped, and each step's mean loss over its window."""

    loss: float
    steps: int
    skipped: int
    step_losses: list[float]


class WindowLosses:
    """Each window's loss sum and samples, kept on the device: added up at the epoch's end in one device sync and
    one all-reduce (every rank's samples), so the loop never waits on the device for a number."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.closed = device, []
        self.sum, self.samples = torch.zeros((), device=device), 0

    def add(self, loss: torch.Tensor, mb: MicroBatch) -> None:
        if mb.weight:  # weight 0: a stand-in so that a rank with no samples left still joins the all-reduce
            self.sum += loss.detach().float() * (mb.stop - mb.start)
            self.samples += mb.stop - mb.start

    def close(self) -> None:
        self.closed.append((self.sum, self.samples))
        self.sum, self.samples = torch.zeros((), device=self.device), 0

    def means(self, steps: int) -> tuple[float, list[float]]:
        """The epoch's mean loss, and each of its `steps` stepped windows' mean: samples after the last step (the
        tutorial's loop, which does not step at an epoch's end) count in the epoch's mean only."""
        self.close()
        losses = torch.stack([w for w, _ in self.closed]).tolist()
        sums = distributed.all_sum(*losses, *(n for _, n in self.closed))
        loss_sums, counts = sums[: len(self.closed)], sums[len(self.closed) :]
        return sum(loss_sums) / sum(counts), [w / n for w, n in zip(loss_sums[:steps], counts[:steps], strict=True)]


def train_epoch(
    learner: Learner,
    images: torch.Tensor,
    labels: torch.Tensor,
    perm: torch.Tensor,
    batches: list[MicroBatch],
    *,
    progress: bool = False,
    no_sync: bool = True,
) -> Epoch:
    """One epoch over `perm`'s order in `batches` (accumulation.schedule: each micro-batch's loss weight, and
    whether an optimizer step follows it).

    Under DDP the gradients are all-reduced once per window: every micro-batch before the window's
    last runs forward and backward inside `no_sync()` (no_sync=False all-reduces each one, to compare).
    """
    model, opt, scaler, dtype = learner.model, learner.opt, learner.scaler, learner.dtype
    model.train()
    windows, steps, skipped = WindowLosses(images.device), 0, 0
    for mb in tqdm(batches, desc="  micro-batches", leave=False, disable=None if progress else True):
        idx = perm[mb.start : mb.stop]
        quiet = isinstance(model, DDP) and no_sync and not mb.step
        with model.no_sync() if quiet else nullcontext():  # the forward too: DDP prepares the all-reduce there
            with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(normalize(images[idx])), labels[idx])
            scaler.scale(loss * mb.weight).backward()  # weight: this micro-batch's share of its window
        windows.add(loss, mb)
        if mb.step:  # the window is complete: one optimizer step on its accumulated gradient
            scale_before = scaler.get_scale()
            scaler.step(opt)  # skipped inside when the scaled gradients hold inf/NaN
            scaler.update()
            opt.zero_grad(set_to_none=True)
            steps += 1
            skipped += int(scaler.is_enabled() and scaler.get_scale() < scale_before)
            windows.close()
    loss, step_losses = windows.means(steps)
    return Epoch(loss, steps, skipped, step_losses)


@torch.inference_mode()  # no autograd bookkeeping at all, cheaper than no_grad; evaluation trains nothing
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int, dtype: torch.dtype | None
) -> tuple[float, float]:
    """Mean loss and accuracy, in chunks of `batch` so evaluation never sets the memory peak."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(labels), batch):
        x, y = normalize(images[start : start + batch]), labels[start : start + batch]
        with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return loss_sum / len(labels), correct / len(labels)


@dataclass
class Curves:
    """What a run of the loop returns: a row per epoch (EPOCH_COLUMNS) and per optimizer step (STEP_COLUMNS)."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)


def train(
    model: nn.Module,
    data: dict[str, torch.Tensor],
    spec: RunSpec,
    seed: int,
    rank: int = 0,
    on_epoch: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
) -> Curves:
    """The whole run; per epoch: loss, test accuracy, steps and speed (evaluation not timed).

    `seed` orders the data (the model's own seed set its weights). The spec's `weighting` and `epoch_end_step`
    other than the defaults reproduce the tutorial's loop (see `schedule`). With spec.world > 1, `model` is
    DDP-wrapped and each rank runs its share of every window. `on_epoch`, if given, is called on rank 0 after
    each epoch with its row and its step rows (DVCLive).
    """
    device, dtype = data["train_x"].device, spec.dtype
    learner = Learner.of(model, spec, device)
    n = len(data["train_y"])
    batches = schedule(n, spec.micro_batch, spec.accum, spec.weighting, spec.epoch_end_step, rank, spec.world)
    shuffle = torch.Generator().manual_seed(seed)
    curves, progress = Curves(), rank == 0
    for epoch in tqdm(range(1, spec.epochs + 1), desc="epochs", unit="epoch", disable=None if progress else True):
        perm = torch.randperm(n, generator=shuffle).to(device)
        start = time.perf_counter()
        run = train_epoch(learner, data["train_x"], data["train_y"], perm, batches, progress=progress)
        train_loss, steps, skipped = run.loss, run.steps, run.skipped
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        test_loss, test_accuracy = evaluate(
            distributed.unwrap(model), data["test_x"], data["test_y"], spec.eval_batch, dtype
        )  # every rank alike, without DDP: no collective to wait on
        done = len(curves.steps)
        epoch_steps = [{"step": done + 1 + i, "epoch": epoch, "train_loss": x} for i, x in enumerate(run.step_losses)]
        curves.steps += epoch_steps
        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "optimizer_steps": steps,
            "skipped_steps": skipped,
            "images_per_second": n / seconds,
            "seconds": seconds,
        }
        curves.epochs.append(row)
        if rank == 0:
            tqdm.write(
                f"  epoch {epoch}: train loss {train_loss:.4f}  test acc {test_accuracy:.4f}  "
                f"{n / seconds:.0f} img/s  {steps} steps ({skipped} skipped)"
            )
            if on_epoch is not None:
                on_epoch(row, epoch_steps)
    return curves
