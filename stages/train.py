"""Stage `train@<variant>`: train one variant, measure its memory, write its metrics, plots and weights.

    python -m stages.train baseline

The loop itself is `stages/loop.py`; this stage wires params, the memory sampler and the outputs around it.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages import distributed, params, planner
from stages.accumulation import micro_batch_size
from stages.loop import EPOCH_COLUMNS, amp_dtype, load_data, train
from stages.memory import TIMELINE_COLUMNS, FirstStepSnapshot, MemorySampler
from stages.models import build_model, count_parameters
from stages.outputs import atomic_path, read_json, write_json, write_table, write_text
from stages.paths import HARDWARE, PROVENANCE, SWEEP_PLAN, variant_dir, weights_path

CORRECTED = {"weighting": "exact", "epoch_end_step": True, "swap": "keep_act"}  # the tutorial's code differs in each


def resolved_accum(p: dict[str, Any], checkpointing: bool = False) -> int | None:
    """accum: auto, from the planner: the fewest micro-batches that fit, with or without checkpointing."""
    if p["accum"] != "auto":
        return None
    plan = read_json(SWEEP_PLAN)
    return plan["auto_accum_checkpointing"] if checkpointing else plan["auto_accum"]


def plan_check(p: dict[str, Any], device: torch.device, micro: int, world: int = 1) -> dict[str, Any] | None:
    """On the CPU the kernel kills rather than raises, so a variant the planner puts over budget is not run.

    With several processes on one host, each holds its own copy: the host needs `world` times one.
    """
    if device.type != "cpu" or not SWEEP_PLAN.exists():
        return None
    fit = read_json(SWEEP_PLAN)["fit"]
    predicted = planner.predict_mib(fit, micro) * world
    budget = p["memory"]["host_budget_gb"] * planner.GIB_MIB
    if predicted <= budget:
        return None
    return {
        "reason": f"planner predicts {predicted:.0f} MiB at micro-batch {micro}"
        + (f" in each of {world} processes" if world > 1 else "")
        + ", over memory.host_budget_gb "
        f"({budget:.0f} MiB)",
        "memory_at_failure_mib": round(predicted),
        "device_total_mib": round(budget),
    }


def main(variant: str, memory_snapshot: Path | None = None) -> None:
    p = params.load()
    if variant not in p["variants"]:
        raise params.ParamsError(f"variant {variant!r} is not in params.yaml variants: {', '.join(p['variants'])}")
    hw = read_json(HARDWARE)
    scale = p["scales"][hw["scale"]]
    v = p["variants"][variant]
    accum = params.variant_accum_steps(p, variant, resolved_accum(p, v["checkpointing"]))
    nproc, sync_bn = p["distributed"]["nproc_per_node"], p["distributed"]["sync_batchnorm"]
    params.check_accum(accum, scale["batch"], f"scales.{hw['scale']}.batch", world=nproc)
    params.check_distributed(p, hw)
    if nproc > 1 and not distributed.launched():  # one process per device, started by torchrun
        sys.exit(distributed.relaunch(nproc, "stages.train", sys.argv[1:]))
    rank, world, device = distributed.setup(hw["device"])
    micro = micro_batch_size(scale["batch"], accum * world)  # per process
    dtype = amp_dtype(device, p["train"], v["precision"])
    data = load_data(device, scale["train_samples"], scale["test_samples"])
    model = build_model(
        **p["model"], norm=v["norm"], seed=p["seed"], swap=v["swap"], checkpointing=v["checkpointing"]
    ).to(device)
    model = distributed.wrap(model, device, sync_bn and v["norm"] == "batch")
    tutorial = [f"{k}: {v[k]}" for k, exact in CORRECTED.items() if v[k] != exact]
    if rank == 0:
        print(
            f"train@{variant}: {v['norm']}norm, accum {accum} x micro-batch {micro}"
            + (f" x {world} processes" if world > 1 else "")
            + f" = batch {scale['batch']}, lr {v['lr']}, {hw['scale']} scale on {device.type}, "
            f"{str(dtype).replace('torch.', '') if dtype else 'float32'}"
            + (", activation checkpointing" if v["checkpointing"] else "")
            + (f"; as the tutorial wrote it: {', '.join(tutorial)}" if tutorial else ""),
            flush=True,
        )

    rows: list[dict[str, Any]] = []
    failure = plan_check(p, device, micro, world)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wanted = memory_snapshot and device.type == "cuda" and rank == 0
    snapshot = FirstStepSnapshot(memory_snapshot) if wanted else nullcontext()
    with MemorySampler(device.type, p["memory"]["interval_ms"], gpu_index=device.index or 0) as sampler, snapshot:
        if failure is None:
            try:
                rows = train(
                    model,
                    data,
                    lr=v["lr"],
                    weight_decay=p["train"]["weight_decay"],
                    batch=scale["batch"],
                    accum=accum,
                    epochs=scale["epochs"],
                    seed=p["seed"],
                    dtype=dtype,
                    eval_batch=min(p["train"]["eval_batch"], micro),  # what fits for training fits here
                    weighting=v["weighting"],
                    epoch_end_step=v["epoch_end_step"],
                    progress=rank == 0,
                    rank=rank,
                    world=world,
                )
            except torch.OutOfMemoryError as err:  # a result, not a crash: the tutorial's baseline on a small card
                if world > 1:
                    raise  # the other ranks wait in an all-reduce: fail them all (torchrun does) rather than hang
                failure = oom_record(err, device)
    memory = sampler.summary()
    if device.type == "cuda":
        memory.update(
            torch_max_allocated_mib=torch.cuda.max_memory_allocated(device) / 2**20,
            torch_max_reserved_mib=torch.cuda.max_memory_reserved(device) / 2**20,
        )
    per_rank = distributed.gather(memory)
    distributed.teardown()
    if rank != 0:
        return  # rank 0 writes the outputs
    if world > 1:  # the headline peaks are the largest process's: what each device must hold
        memory = {
            k: max(m[k] for m in per_rank) if k.endswith("_mib") and memory[k] is not None else memory[k]
            for k in memory
        } | {"per_rank": per_rank}
    metrics = {
        "variant": variant,
        "norm": v["norm"],
        **{key: v[key] for key in CORRECTED},
        "checkpointing": v["checkpointing"],
        "precision": v["precision"],
        "accum": accum,
        "accum_setting": v["accum"] if v["accum"] != "accum" else p["accum"],  # "auto" resolved into accum
        "micro_batch": micro,
        "world_size": world,
        "sync_batchnorm": sync_bn and v["norm"] == "batch" and world > 1,
        "batch": scale["batch"],
        "lr": v["lr"],
        "scale": hw["scale"],
        "device": hw["device"],
        "amp": str(dtype).replace("torch.", "") if dtype else "float32",
        "train_samples": len(data["train_y"]),
        "test_samples": len(data["test_y"]),
        "dataset": read_json(PROVENANCE)["kind"],
        "parameters": count_parameters(distributed.unwrap(model)),
        "fit": failure is None,
        "did_not_fit": failure,
        "final_train_loss": rows[-1]["train_loss"] if rows else None,
        "test_accuracy": rows[-1]["test_accuracy"] if rows else None,
        "images_per_second": float(np.median([r["images_per_second"] for r in rows])) if rows else None,
        "optimizer_steps": sum(r["optimizer_steps"] for r in rows),
        "skipped_steps": sum(r["skipped_steps"] for r in rows),
        "train_seconds": sum(r["seconds"] for r in rows),
        "memory": memory,
    }
    out = variant_dir(variant)
    write_table(out / "epochs.tsv", rows, EPOCH_COLUMNS)
    write_table(out / "memory.csv", sampler.rows, TIMELINE_COLUMNS, delimiter=",")
    write_text(
        out / "nvidia-smi.txt", sampler.peak_snapshot or "no nvidia-smi snapshot (CPU run or nvidia-smi missing)\n"
    )
    with atomic_path(weights_path(variant)) as tmp:
        torch.save(distributed.unwrap(model).state_dict() if failure is None else {}, tmp)
    write_json(out / "metrics.json", metrics)
    print(f"train@{variant}: {'did not fit: ' + failure['reason'] if failure else 'done'}; peak memory {memory}")


def oom_record(err: BaseException, device: torch.device) -> dict[str, Any]:
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 0
    used = torch.cuda.max_memory_reserved() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "reason": f"out of memory: {str(err).splitlines()[0][:300]}",
        "memory_at_failure_mib": round(used / 2**20),
        "device_total_mib": round(total / 2**20),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument(
        "--memory-snapshot",
        type=Path,
        metavar="PICKLE",
        help="on a GPU, dump PyTorch's memory history up to the first optimizer step there (scripts/gpu_check.sh)",
    )
    args = parser.parse_args()
    try:
        main(args.variant, args.memory_snapshot)
    except params.ParamsError as err:
        sys.exit(f"error: {err}")
