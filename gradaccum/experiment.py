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

from gradaccum import distributed, params, planner
from gradaccum.accumulation import micro_batch_size
from gradaccum.loop import amp_dtype, train
from gradaccum.memory import MIB, FirstStepSnapshot, MemorySampler, is_out_of_memory, peak_rss_mib
from gradaccum.models import build_model, count_parameters
from gradaccum.params import Params, Scale, Variant
from gradaccum.records import CudnnRun, DidNotFit, MemoryPeaks, SeedRun, VariantRecord
from gradaccum.tutorial import CORRECTED, CUDNN, kept_mistakes


def resolved_accum(p: Params, plan: dict[str, Any] | None, checkpointing: bool = False) -> int | None:
    """accum: auto, from the planner: the fewest micro-batches that fit, with or without checkpointing."""
    if p.accum != "auto" or plan is None:
        return None
    return plan["auto_accum_checkpointing"] if checkpointing else plan["auto_accum"]


def plan_check(
    p: Params, device: torch.device, micro: int, plan: dict[str, Any] | None, world: int = 1
) -> DidNotFit | None:
    """On the CPU the kernel kills rather than raises, so a variant the planner puts over budget is not run.

    With several processes on one host, each holds its own copy: the host needs `world` times one.
    """
    if device.type != "cpu" or plan is None:
        return None
    predicted = planner.predict_mib(plan["fit"], micro) * world
    budget = p.memory.host_budget_gb * planner.GIB_MIB
    if predicted <= budget:
        return None
    return DidNotFit(
        reason=f"planner predicts {predicted:.0f} MiB at micro-batch {micro}"
        + (f" in each of {world} processes" if world > 1 else "")
        + f", over memory.host_budget_gb ({budget:.0f} MiB)",
        memory_at_failure_mib=round(predicted),
        device_total_mib=round(budget),
    )


def emulation_check(p: Params, hw: dict[str, Any], dtype: torch.dtype | None) -> str | None:
    """bfloat16 on a CPU without its kernels is emulated, many times slower than float32, and says nothing of a
    GPU: not run. The text names the benchmark that measures the slowdown on the CPU it runs on."""
    if hw["device"] != "cpu" or dtype != torch.bfloat16 or hw["cpu"]["native_bfloat16"] or p.train.emulated_bfloat16:
        return None
    return (
        "this CPU has no bfloat16 kernels, so bfloat16 would be emulated in software, many times slower than "
        "float32 (`python -m benchmarks.convolutions` times both on this CPU); train.emulated_bfloat16: true "
        "trains it anyway"
    )


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


def check_auto(plan: dict[str, Any] | None, checkpointing: bool) -> None:
    """accum: auto needs the sweep's result and something in it that fits; say which is missing."""
    if plan is None:
        raise params.ParamsError(
            "params.yaml: accum = 'auto' needs the memory planner's result, reports/sweep/planner.json, "
            "which is missing: run `dvc repro sweep` first"
        )
    lever = "checkpointing" if checkpointing else "accumulation"
    if plan["auto_accum_checkpointing" if checkpointing else "auto_accum"] is None:
        fit, machine = plan["fit_checkpointing" if checkpointing else "fit"], plan["this_machine"]
        usable = machine["memory_mib"] * (1 - machine["safety_margin"])
        raise params.ParamsError(
            f"params.yaml: accum = 'auto' finds nothing that fits ({lever}): the planner predicts "
            f"{planner.predict_mib(fit, 1):.0f} MiB even at micro-batch 1, over the usable {usable:.0f} MiB of "
            f"{machine['what']} (memory.safety_margin {machine['safety_margin']}); set accum to an integer to try"
        )


def variant_accum(p: Params, variant: str, plan: dict[str, Any] | None, scale_name: str) -> int:
    """The accumulation steps a variant runs with, checked against the batch of the scale that runs."""
    if p.accum == "auto" and p.variants[variant].accum == "accum":
        check_auto(plan, p.variants[variant].checkpointing)
    accum = params.variant_accum_steps(p, variant, resolved_accum(p, plan, p.variants[variant].checkpointing))
    batch, nproc = p.scale_settings(scale_name).batch, p.distributed.nproc_per_node
    params.check_accum(accum, batch, f"scales.{scale_name}.batch", world=nproc)
    return accum


def headline(variant: str, v: Variant, accum: int, micro: int, world: int, batch: int, hw: dict, dtype) -> str:
    """The one line that says what this run is, the tutorial's mistakes it keeps included."""
    tutorial = [f"{c.key}: {getattr(v, c.key)}" for c in kept_mistakes(v.model_dump())]
    return (
        f"train@{variant}: {v.norm}norm, accum {accum} x micro-batch {micro}"
        + (f" x {world} processes" if world > 1 else "")
        + f" = batch {batch}, lr {v.lr}, {hw['scale']} scale on {hw['device']}, "
        f"{str(dtype).replace('torch.', '') if dtype else 'float32'}"
        + (", activation checkpointing" if v.checkpointing else "")
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
    p: Params,
    variant: str,
    hw: dict[str, Any],
    data: dict[str, torch.Tensor],
    plan: dict[str, Any] | None,
    rank: int = 0,
    world: int = 1,
    memory_snapshot: Path | None = None,
    on_epoch: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
) -> VariantRun:
    """Train one variant inside the memory sampler; returns its record, epoch rows, timeline and weights.

    `on_epoch` follows the first seed's run as it goes (the stage's DVCLive logger)."""
    v, scale = p.variants[variant], p.scale_settings(hw["scale"])
    device = data["train_x"].device
    accum = variant_accum(p, variant, plan, hw["scale"])
    micro = micro_batch_size(scale.batch, accum * world)  # per process
    dtype = amp_dtype(device, p.train, v.precision)
    sync_bn = p.distributed.sync_batchnorm and v.norm == "batch"
    model = variant_model(p, variant, p.seed, device, sync_bn)
    if rank == 0:
        print(headline(variant, v, accum, micro, world, scale.batch, hw, dtype), flush=True)
    failure, not_run = plan_check(p, device, micro, plan, world), emulation_check(p, hw, dtype)
    steps: list[dict[str, Any]] = []
    first_seed = partial(
        train_variant, model, data, p, variant, scale, accum, dtype, p.seed, rank, world, steps, on_epoch
    )
    with cudnn_settings(v.cudnn, device) as cudnn:
        rows, failure, sampler, alone = measured_training(
            first_seed, device, p.memory.interval_ms, failure, rank, world, memory_snapshot, not not_run
        )
        memory = peak_memory(sampler, device, 1 if alone else world)  # alone: no collective can complete
        seeds, seconds = [], sum(r["seconds"] for r in rows)
        if rows:  # the first seed's end point, then each further seed's run: the yardstick for every difference
            end = rows[-1]
            seeds = [SeedRun(seed=p.seed, final_train_loss=end["train_loss"], test_accuracy=end["test_accuracy"])]
            for seed in range(p.seed + 1, p.seed + p.seeds):
                again = variant_model(p, variant, seed, device, sync_bn)
                more = train_variant(again, data, p, variant, scale, accum, dtype, seed, rank, world)
                seconds, end = seconds + sum(r["seconds"] for r in more), more[-1]
                seeds.append(SeedRun(seed=seed, final_train_loss=end["train_loss"], test_accuracy=end["test_accuracy"]))
    record = VariantRecord(
        variant=variant,
        norm=v.norm,
        **{key: getattr(v, key) for key in CORRECTED},
        checkpointing=v.checkpointing,
        precision=v.precision,
        cudnn=cudnn,
        accum=accum,
        accum_setting=v.accum if v.accum != "accum" else p.accum,  # "auto" resolved into accum
        micro_batch=micro,
        world_size=world,
        sync_batchnorm=sync_bn and world > 1,
        batch=scale.batch,
        lr=v.lr,
        scale=hw["scale"],
        device=hw["device"],
        amp=str(dtype).replace("torch.", "") if dtype else "float32",
        train_samples=len(data["train_y"]),
        test_samples=len(data["test_y"]),
        parameters=count_parameters(distributed.unwrap(model)),
        fit=failure is None and not_run is None,
        did_not_fit=failure,
        not_run=not_run,
        final_train_loss=rows[-1]["train_loss"] if rows else None,
        test_accuracy=rows[-1]["test_accuracy"] if rows else None,
        images_per_second=float(np.median([r["images_per_second"] for r in rows])) if rows else None,
        optimizer_steps=sum(r["optimizer_steps"] for r in rows),
        skipped_steps=sum(r["skipped_steps"] for r in rows),
        seeds=seeds,
        train_seconds=seconds,
        memory=memory,
    )
    weights = distributed.unwrap(model).state_dict() if record.fit else {}
    return VariantRun(record, rows, sampler, weights, steps, alone)


def variant_model(p: Params, variant: str, seed: int, device: torch.device, sync_bn: bool) -> torch.nn.Module:
    """The variant's model, initialised from `seed`, DDP-wrapped under torchrun."""
    v = p.variants[variant]
    model = build_model(
        **p.model.model_dump(), norm=v.norm, seed=seed, swap=v.swap, checkpointing=v.checkpointing, device=device
    )
    return distributed.wrap(model, device, sync_bn)


def train_variant(
    model: torch.nn.Module,
    data: dict[str, torch.Tensor],
    p: Params,
    variant: str,
    scale: Scale,
    accum: int,
    dtype: torch.dtype | None,
    seed: int,
    rank: int,
    world: int,
    step_rows: list[dict[str, Any]] | None = None,
    on_epoch: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """The loop with the variant's settings; `seed` orders the data (the model's own seed set its weights)."""
    v = p.variants[variant]
    return train(
        model,
        data,
        lr=v.lr,
        weight_decay=p.train.weight_decay,
        batch=scale.batch,
        accum=accum,
        epochs=scale.epochs,
        seed=seed,
        dtype=dtype,
        eval_batch=min(p.train.eval_batch, micro_batch_size(scale.batch, accum * world)),  # fits as training does
        weighting=v.weighting,
        epoch_end_step=v.epoch_end_step,
        progress=rank == 0,
        rank=rank,
        world=world,
        step_rows=step_rows,
        on_epoch=on_epoch,
    )


def measured_training(
    train_once: Callable[[], list[dict[str, Any]]],
    device: torch.device,
    interval_ms: int,
    failure: DidNotFit | None,
    rank: int,
    world: int,
    memory_snapshot: Path | None,
    run: bool = True,
) -> tuple[list[dict[str, Any]], DidNotFit | None, MemorySampler, bool]:
    """`train_once` inside the memory sampler (and PyTorch's memory history, if asked); out of memory is a result.

    Nothing trains when `failure` is set already or `run` is false. The last value is true when this rank ran
    out of memory in a run of several: the others wait for it in an all-reduce that will never complete.
    """
    rows: list[dict[str, Any]] = []
    alone = False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wanted = memory_snapshot and device.type == "cuda" and rank == 0
    snapshot = FirstStepSnapshot(memory_snapshot) if wanted else nullcontext()
    with MemorySampler(device.type, interval_ms, gpu_index=device.index or 0) as sampler, snapshot:
        if failure is None and run:
            try:
                rows = train_once()
            except Exception as err:  # out of memory is a result, not a crash: the tutorial's baseline on a small card
                if not is_out_of_memory(err):
                    raise
                failure, alone = oom_record(err, device), world > 1
    return rows, failure, sampler, alone


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
