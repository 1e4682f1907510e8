"""One variant of the study, run and measured: the loop inside the memory sampler, its record assembled.

The `train@<variant>` stage wires the pipeline's files around `run_variant`; the loop itself is
`gradaccum/loop.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradaccum import distributed
from gradaccum.loop import Curves, train
from gradaccum.memory import MIB, FirstStepSnapshot, MemorySampler, is_out_of_memory, peak_rss_mib
from gradaccum.models import count_parameters, spec_model
from gradaccum.records import FORMAT, CudnnRun, DidNotFit, MemoryPeaks, SeedRun, Settings, VariantRecord
from gradaccum.spec import RunSpec
from gradaccum.tutorial import CUDNN, kept_mistakes


def oom_record(err: BaseException, device: torch.device) -> DidNotFit:
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 0
    used = torch.cuda.max_memory_reserved() if device.type == "cuda" else peak_rss_mib() * MIB
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return DidNotFit(
        reason=f"out of memory: {str(err).splitlines()[0][:300]}",
        memory_at_failure_mib=round(used / 2**20),
        device_total_mib=round(total / 2**20),
    )


def headline(spec: RunSpec) -> str:
    """The one line that says what this run is, the tutorial's mistakes it keeps included."""
    tutorial = [f"{c.key}: {getattr(spec, c.key)}" for c in kept_mistakes(spec.model_dump())]
    return (
        f"train@{spec.variant}: {spec.norm}norm, accum {spec.accum} x micro-batch {spec.micro_batch}"
        + (f" x {spec.world} processes" if spec.world > 1 else "")
        + f" = batch {spec.batch}, lr {spec.lr}, {spec.scale} scale on {spec.device}, {spec.amp}"
        + (", activation checkpointing" if spec.checkpointing else "")
        + (f"; as the tutorial wrote it: {', '.join(tutorial)}" if tutorial else "")
    )


@dataclass
class VariantRun:
    """What one variant's run leaves: the record, a row per epoch, the sampler's timeline, the trained weights."""

    record: VariantRecord
    epochs: list[dict[str, Any]]
    sampler: MemorySampler
    weights: dict[str, torch.Tensor]
    steps: list[dict[str, Any]]  # a row per optimizer step (loop.STEP_COLUMNS), the first seed's
    alone: bool = False  # this rank ran out of memory while the others wait in a collective: it writes the record


def run_variant(
    spec: RunSpec,
    data: dict[str, torch.Tensor],
    rank: int = 0,
    memory_snapshot: Path | None = None,
    on_epoch: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
) -> VariantRun:
    """Train one variant inside the memory sampler; returns its record, epoch rows, timeline and weights.

    `on_epoch` follows the first seed's run as it goes (the stage's DVCLive logger)."""
    device = data["train_x"].device
    model = variant_model(spec, spec.seed, device)
    if rank == 0:
        print(headline(spec), flush=True)
    first_seed = partial(train, model, data, spec, spec.seed, rank, on_epoch)
    with cudnn_settings(spec.cudnn, device) as cudnn:
        curves, failure, sampler, alone = measured_training(first_seed, spec, device, rank, memory_snapshot)
        memory = peak_memory(sampler, device, 1 if alone else spec.world)  # alone: no collective can complete
        rows, seeds = curves.epochs, []
        seconds = sum(r["seconds"] for r in rows)
        if rows:  # the first seed's end point, then each further seed's run: the yardstick for every difference
            runs = [rows[-1]]
            for seed in range(spec.seed + 1, spec.seed + spec.seeds):
                more = train(variant_model(spec, seed, device), data, spec, seed, rank).epochs
                seconds, runs = seconds + sum(r["seconds"] for r in more), [*runs, more[-1]]
            seeds = [
                SeedRun(seed=spec.seed + i, final_train_loss=end["train_loss"], test_accuracy=end["test_accuracy"])
                for i, end in enumerate(runs)
            ]
    record = VariantRecord(
        format=FORMAT,
        **spec.model_dump(include=set(Settings.model_fields)),
        world_size=spec.world,
        cudnn=cudnn,
        train_samples=len(data["train_y"]),
        test_samples=len(data["test_y"]),
        parameters=count_parameters(distributed.unwrap(model)),
        completed=failure is None and spec.not_run is None,
        did_not_fit=failure,
        not_run=spec.not_run,
        final_train_loss=rows[-1]["train_loss"] if rows else None,
        test_accuracy=rows[-1]["test_accuracy"] if rows else None,
        images_per_second=float(np.median([r["images_per_second"] for r in rows])) if rows else None,
        optimizer_steps=sum(r["optimizer_steps"] for r in rows),
        skipped_steps=sum(r["skipped_steps"] for r in rows),
        seeds=seeds,
        train_seconds=seconds,
        memory=memory,
    )
    weights = distributed.unwrap(model).state_dict() if record.completed else {}
    return VariantRun(record, rows, sampler, weights, curves.steps, alone)


def variant_model(spec: RunSpec, seed: int, device: torch.device) -> torch.nn.Module:
    """The variant's model, initialised from `seed`, DDP-wrapped under torchrun."""
    return distributed.wrap(spec_model(spec, seed, device), device, spec.sync_batchnorm)


def measured_training(
    train_once: Callable[[], Curves], spec: RunSpec, device: torch.device, rank: int, memory_snapshot: Path | None
) -> tuple[Curves, DidNotFit | None, MemorySampler, bool]:
    """`train_once` inside the memory sampler (and PyTorch's memory history, if asked); out of memory is a result.

    Nothing trains when the spec says it does not run. The last value is true when this rank ran out of memory
    in a run of several: the others wait for it in an all-reduce that will never complete.
    """
    curves, failure, alone = Curves(), spec.over_budget, False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wanted = memory_snapshot and device.type == "cuda" and rank == 0
    snapshot = FirstStepSnapshot(memory_snapshot) if wanted else nullcontext()
    with MemorySampler(device.type, spec.memory_interval_ms, gpu_index=device.index or 0) as sampler, snapshot:
        if spec.runs():
            try:
                curves = train_once()
            except Exception as err:  # out of memory is a result, not a crash: the tutorial's baseline on a small card
                if not is_out_of_memory(err):
                    raise
                failure, alone = oom_record(err, device), spec.world > 1
    return curves, failure, sampler, alone


def peak_memory(sampler: MemorySampler, device: torch.device, world: int) -> MemoryPeaks:
    """The sampler's peaks with PyTorch's own; across processes, the largest one's (what each device must hold)."""
    memory = sampler.summary()
    if device.type == "cuda":
        memory.update(
            torch_max_allocated_mib=torch.cuda.max_memory_allocated(device) / 2**20,
            torch_max_reserved_mib=torch.cuda.max_memory_reserved(device) / 2**20,
        )
    if world == 1:
        return MemoryPeaks(**memory)
    per_rank = distributed.gather(memory)
    largest = {
        k: max(m[k] for m in per_rank) if k.endswith("_mib") and memory[k] is not None else memory[k] for k in memory
    }
    return MemoryPeaks(**largest, per_rank=[MemoryPeaks(**m) for m in per_rank])


@contextlib.contextmanager
def cudnn_settings(setting: str, device: torch.device) -> Iterator[dict[str, Any]]:
    """The variant's cuDNN flags while it trains, and a record of what ran: on a CPU nothing changes (cuDNN is
    CUDA's library) and the record says so."""
    flags = CUDNN[setting]  # gradaccum/tutorial.py
    if device.type != "cuda":
        yield CudnnRun(setting=setting, applied=False, note="a CPU: cuDNN is CUDA's library, nothing was set")
        return
    cudnn = torch.backends.cudnn
    saved = {k: getattr(cudnn, k) for k in flags}
    for k, value in flags.items():
        setattr(cudnn, k, value)
    try:
        yield CudnnRun(setting=setting, applied=True, **flags)
    finally:
        for k, value in saved.items():
            setattr(cudnn, k, value)
