"""Stage `train@<variant>`: train one variant, measure its memory, write its metrics, plots and weights.

    python -m stages.train baseline

The loop is `train_epoch` below: micro-batches weighted by their share of the window, one
optimizer step per window, GradScaler stepping only at window boundaries.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages import mnist, params, planner
from stages.accumulation import MicroBatch, micro_batch_size, windows
from stages.download import DATASET, PROVENANCE
from stages.hardware import HARDWARE
from stages.memory import TIMELINE_COLUMNS, MemorySampler
from stages.models import build_model, count_parameters
from stages.outputs import atomic_path, read_json, write_json, write_table, write_text

SWEEP_PLAN = Path("reports/sweep/planner.json")
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
AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": None}  # float32: no autocast


def variant_dir(variant: str) -> Path:
    return Path("reports/variants") / variant


def weights_path(variant: str) -> Path:
    return Path("data/models") / f"{variant}.pt"


def amp_dtype(device: torch.device, train: dict[str, Any]) -> torch.dtype | None:
    """float16 needs a GradScaler (small gradients underflow); bfloat16 has float32's range and does not."""
    return AMP_DTYPES[train["amp_cuda"] if device.type == "cuda" else train["amp_cpu"]]


def normalize(images: torch.Tensor) -> torch.Tensor:
    """ToTensor + Normalize((0.5,), (1.0,)) as the tutorial, on a whole uint8 batch at once."""
    return (images.float() / 255.0 - 0.5).unsqueeze(1)


def train_epoch(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    images: torch.Tensor,
    labels: torch.Tensor,
    perm: torch.Tensor,
    plan: list[list[MicroBatch]],
    dtype: torch.dtype | None,
) -> tuple[float, int, int]:
    """One epoch; returns (mean training loss over samples, optimizer steps, steps the scaler skipped)."""
    model.train()
    loss_sum = torch.zeros((), device=images.device)
    skipped = 0
    for window in plan:
        for mb in window:
            idx = perm[mb.start : mb.stop]
            with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(normalize(images[idx])), labels[idx])
            scaler.scale(loss * mb.weight).backward()  # weight = this micro-batch's share of the window
            loss_sum += loss.detach().float() * (mb.stop - mb.start)
        scale = scaler.get_scale()
        scaler.step(opt)  # skipped inside when the scaled gradients hold inf/NaN
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped += int(scaler.is_enabled() and scaler.get_scale() < scale)
    return float(loss_sum) / len(perm), len(plan), skipped


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int, dtype: torch.dtype | None
) -> tuple[float, float]:
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(labels), batch):
        x, y = normalize(images[start : start + batch]), labels[start : start + batch]
        with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return loss_sum / len(labels), correct / len(labels)


def train(
    model: nn.Module,
    data: dict[str, torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    batch: int,
    accum: int,
    epochs: int,
    seed: int,
    dtype: torch.dtype | None,
    eval_batch: int,
) -> list[dict[str, Any]]:
    """The whole run; per epoch: loss, test accuracy, steps and speed (evaluation not timed)."""
    device = data["train_x"].device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    n = len(data["train_y"])
    plan = windows(n, micro_batch_size(batch, accum), accum)  # the same split every epoch; the order changes
    shuffle = torch.Generator().manual_seed(seed)
    rows = []
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(n, generator=shuffle).to(device)
        start = time.perf_counter()
        train_loss, steps, skipped = train_epoch(
            model, opt, scaler, data["train_x"], data["train_y"], perm, plan, dtype
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        test_loss, test_accuracy = evaluate(model, data["test_x"], data["test_y"], eval_batch, dtype)
        rows.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "optimizer_steps": steps,
                "skipped_steps": skipped,
                "images_per_second": n / seconds,
                "seconds": seconds,
            }
        )
        print(
            f"  epoch {epoch}: train loss {train_loss:.4f}  test acc {test_accuracy:.4f}  "
            f"{n / seconds:.0f} img/s  {steps} steps ({skipped} skipped)",
            flush=True,
        )
    return rows


def load_data(device: torch.device, train_samples: int, test_samples: int) -> dict[str, torch.Tensor]:
    """The whole (sub)set on the device as uint8 tensors, once; batches are index lookups."""
    arrays = mnist.load(DATASET)
    keep = {"train_x": train_samples, "train_y": train_samples, "test_x": test_samples, "test_y": test_samples}
    data = {key: torch.from_numpy(np.ascontiguousarray(arrays[key][:n])).to(device) for key, n in keep.items()}
    data["train_y"], data["test_y"] = data["train_y"].long(), data["test_y"].long()
    return data


def resolved_accum(p: dict[str, Any]) -> int | None:
    return read_json(SWEEP_PLAN)["auto_accum"] if p["accum"] == "auto" else None


def plan_check(p: dict[str, Any], device: torch.device, micro: int) -> dict[str, Any] | None:
    """On the CPU the kernel kills rather than raises, so a variant the planner puts over budget is not run."""
    if device.type != "cpu" or not SWEEP_PLAN.exists():
        return None
    fit = read_json(SWEEP_PLAN)["fit"]
    predicted = planner.predict_mib(fit, micro)
    budget = p["memory"]["host_budget_gb"] * planner.GIB_MIB
    if predicted <= budget:
        return None
    return {
        "reason": f"planner predicts {predicted:.0f} MiB at micro-batch {micro}, over memory.host_budget_gb "
        f"({budget:.0f} MiB)",
        "memory_at_failure_mib": round(predicted),
        "device_total_mib": round(budget),
    }


def main(variant: str) -> None:
    p = params.load()
    if variant not in p["variants"]:
        raise params.ParamsError(f"variant {variant!r} is not in params.yaml variants: {', '.join(p['variants'])}")
    hw = read_json(HARDWARE)
    device = torch.device(hw["device"])
    scale = p["scales"][hw["scale"]]
    v = p["variants"][variant]
    accum = params.variant_accum_steps(p, variant, resolved_accum(p))
    params.check_accum(accum, scale["batch"], f"scales.{hw['scale']}.batch")
    micro = micro_batch_size(scale["batch"], accum)
    dtype = amp_dtype(device, p["train"])
    data = load_data(device, scale["train_samples"], scale["test_samples"])
    model = build_model(**p["model"], norm=v["norm"], seed=p["seed"]).to(device)
    print(
        f"train@{variant}: {v['norm']}norm, accum {accum} x micro-batch {micro} = batch {scale['batch']}, "
        f"lr {v['lr']}, {hw['scale']} scale on {device}, {p['train']['amp_' + device.type]}",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    failure = plan_check(p, device, micro)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with MemorySampler(device.type, p["memory"]["interval_ms"]) as sampler:
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
                )
            except torch.OutOfMemoryError as err:  # a result, not a crash: the tutorial's baseline on a small card
                failure = oom_record(err, device)
    memory = sampler.summary()
    if device.type == "cuda":
        memory.update(
            torch_max_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
            torch_max_reserved_mib=torch.cuda.max_memory_reserved() / 2**20,
        )
    metrics = {
        "variant": variant,
        "norm": v["norm"],
        "accum": accum,
        "accum_setting": v["accum"] if v["accum"] != "accum" else p["accum"],  # "auto" resolved into accum
        "micro_batch": micro,
        "batch": scale["batch"],
        "lr": v["lr"],
        "scale": hw["scale"],
        "device": hw["device"],
        "amp": str(dtype).replace("torch.", "") if dtype else "float32",
        "train_samples": len(data["train_y"]),
        "test_samples": len(data["test_y"]),
        "dataset": read_json(PROVENANCE)["kind"],
        "parameters": count_parameters(model),
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
        torch.save(model.state_dict() if failure is None else {}, tmp)
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
    try:
        main(parser.parse_args().variant)
    except params.ParamsError as err:
        sys.exit(f"error: {err}")
