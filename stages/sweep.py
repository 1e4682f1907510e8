"""Stage `sweep`: peak memory at a ladder of micro-batch sizes, and the planner fitted on it.

Each point runs in a fresh process, so the kernel's RSS high-water mark (CPU) and the CUDA
context and caches (GPU) belong to that point alone.

    python -m stages.sweep              # the ladder in params.yaml, then the fit and card table
    python -m stages.sweep --point 256  # one point; prints its JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import psutil
import torch

from stages import params, planner
from stages.accumulation import schedule
from stages.loop import amp_dtype, train_epoch
from stages.memory import MIB, peak_rss_mib
from stages.models import build_model
from stages.outputs import read_json, write_json, write_table
from stages.paths import HARDWARE, SWEEP_PLAN, SWEEP_POINTS

POINT_COLUMNS = (
    "micro_batch",
    "checkpointing",
    "images_per_s",
    "fit",
    "peak_mib",
    "rss_peak_mib",
    "torch_max_allocated_mib",
    "torch_max_reserved_mib",
    "cuda_context_mib",
    "error",
)
IMAGE_SIZE = 28  # MNIST and Fashion-MNIST alike; memory does not depend on pixel values
LEVERS = {"accumulation": False, "checkpointing": True}  # the planner's levers: checkpointing off or on


def measure_point(p: dict[str, Any], device: torch.device, micro: int, checkpointing: bool = False) -> dict[str, Any]:
    """A few optimizer steps of the real training loop at one micro-batch size (GroupNorm, accum 1)."""
    steps = p["memory"]["sweep_steps"]
    model = build_model(**p["model"], norm="group", seed=p["seed"], checkpointing=checkpointing).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = amp_dtype(device, p["train"])
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    n = micro * steps
    images = torch.randint(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    labels = torch.randint(0, p["model"]["num_classes"], (n,), device=device)
    row: dict[str, Any] = dict.fromkeys(POINT_COLUMNS)
    row.update(micro_batch=micro, checkpointing=checkpointing, fit=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        train_epoch(model, opt, scaler, images, labels, torch.arange(n, device=device), schedule(n, micro, 1), dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["images_per_s"] = round(n / (time.perf_counter() - start), 1)  # the first step's warm-up included
    except torch.OutOfMemoryError as err:
        row.update(fit=False, error=str(err).splitlines()[0][:200])
    row["rss_peak_mib"] = round(peak_rss_mib(), 1)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        row.update(
            torch_max_allocated_mib=round(torch.cuda.max_memory_allocated() / MIB, 1),
            torch_max_reserved_mib=round(torch.cuda.max_memory_reserved() / MIB, 1),
            cuda_context_mib=round((total - free - reserved) / MIB, 1),
        )  # what nvidia-smi adds on top
        row["peak_mib"] = round(row["torch_max_reserved_mib"] + row["cuda_context_mib"], 1)
    else:
        row["peak_mib"] = row["rss_peak_mib"]
    return row


def run_point(micro: int, device: str, checkpointing: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stages.sweep", "--point", str(micro), "--device", device]
    cmd += ["--checkpointing"] if checkpointing else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # a killed point is a result
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    row: dict[str, Any] = dict.fromkeys(POINT_COLUMNS)
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    row.update(micro_batch=micro, checkpointing=checkpointing, fit=False, error=f"exit {proc.returncode}: {tail[:200]}")
    return row


def device_memory_mib(hw: dict[str, Any], p: dict[str, Any]) -> tuple[float, str]:
    if hw["device"] == "cuda":
        return float(hw["gpu"]["memory_total_mib"]), f"{hw['gpu']['name']} memory"
    host = psutil.virtual_memory().total / MIB
    budget = p["memory"]["host_budget_gb"] * planner.GIB_MIB
    return min(host, budget), "host memory (min of RAM and memory.host_budget_gb)"


def main() -> None:
    p = params.load()
    hw = read_json(HARDWARE)
    scale = p["scales"][hw["scale"]]
    rows = []
    for checkpointing in (False, True):  # the plain model, then with activation checkpointing
        for micro in scale["sweep_micro_batches"]:
            row = run_point(micro, hw["device"], checkpointing)
            print(
                f"sweep: micro-batch {micro}{' (checkpointing)' if checkpointing else ''}: "
                + (f"peak {row['peak_mib']} MiB" if row["fit"] else f"did not fit ({row['error']})"),
                flush=True,
            )
            rows.append(row)
    fits, speeds = {}, {}
    for lever, checkpointing in LEVERS.items():
        fitted = [r for r in rows if r["fit"] and r["checkpointing"] == checkpointing]
        fits[lever] = planner.fit([r["micro_batch"] for r in fitted], [r["peak_mib"] for r in fitted])
        speeds[lever] = ([r["micro_batch"] for r in fitted], [r["images_per_s"] for r in fitted])
    fit = fits["accumulation"]
    memory_mib, memory_what = device_memory_mib(hw, p)
    margin = p["memory"]["safety_margin"]
    usable = memory_mib * (1 - margin)
    auto = planner.smallest_accum(fit, usable, scale["batch"])
    auto_checkpointing = planner.smallest_accum(fits["checkpointing"], usable, scale["batch"])
    write_table(SWEEP_POINTS, rows, POINT_COLUMNS)
    write_json(
        SWEEP_PLAN,
        {
            "device": hw["device"],
            "scale": hw["scale"],
            "batch": scale["batch"],
            "measure": "reserved + CUDA context (what nvidia-smi shows)"
            if hw["device"] == "cuda"
            else "peak RSS (host memory)",
            "fit": fit,
            "fit_checkpointing": fits["checkpointing"],
            "points": rows,
            "this_machine": {
                "memory_mib": round(memory_mib),
                "what": memory_what,
                "safety_margin": margin,
                "options": planner.options(fits, speeds, usable, scale["batch"]),
            },
            "auto_accum": auto,  # for the variants without checkpointing: fewer micro-batches, faster
            "auto_accum_checkpointing": auto_checkpointing,  # for those with it
            "cards": planner.card_table(fit, scale["batch"], p["memory"]["cards_gb"], margin, fits, speeds),
        },
    )
    print(
        f"sweep: peak = {fit['fixed_mib']:.0f} MiB + {fit['per_sample_mib']:.3f} MiB/sample (r2 {fit['r2']:.3f}); "
        f"accum auto -> {auto}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", type=int, help="measure one micro-batch size and print its JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --point")
    parser.add_argument("--checkpointing", action="store_true", help="with --point: activation checkpointing on")
    args = parser.parse_args()
    try:
        if args.point:
            print(json.dumps(measure_point(params.load(), torch.device(args.device), args.point, args.checkpointing)))
        else:
            main()
    except (params.ParamsError, ValueError) as err:
        sys.exit(f"error: {err}")
