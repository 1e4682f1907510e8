"""Benchmarks, each comparison measured side by side in one run (ratios of medians over repeats).

    make bench        # or: python -m benchmarks.run [--repeats 3] [--out benchmarks/results/NAME.json]

1. this project's training (its loop: data on the device, whole-batch normalize; on the CPU its model's depthwise
   convolutions as matrix products) against the tutorial's loop and model
   (torchvision MNIST + ToTensor + Normalize through a DataLoader with workers): images/s;
2. the cost of accumulation: accum 1 against 4 and 8 at one effective batch (GroupNorm in all);
3. the memory sampler's overhead: training with it against without;
4. peak memory against micro-batch, measured, beside the planner's prediction from a separate fit;
5. data parallelism on 2 gloo processes: all-reduces and seconds per window with and without no_sync.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gradaccum import mnist, params, planner
from gradaccum.accumulation import accum_for, micro_batch_size, schedule
from gradaccum.loop import Learner, train_epoch
from gradaccum.machine import cpu_name
from gradaccum.memory import MemorySampler
from gradaccum.models import build_model, spec_model
from gradaccum.outputs import write_json
from gradaccum.params import Params, Variant
from gradaccum.records import Hardware
from gradaccum.spec import RunSpec, declared_spec, sweep_spec
from gradaccum.sweep import run_point

SIZES = {  # per device: images per timed run, micro-batch, effective batch, sweep sizes (fit / check)
    "cpu": {"images": 512, "micro": 128, "batch": 512, "fit": [64, 256, 512], "check": [128, 384]},
    "cuda": {"images": 65536, "micro": 8192, "batch": 32768, "fit": [1024, 4096, 8192], "check": [2048, 6144]},
}


def median_time(fn: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def write_idx(folder: Path, arrays: dict[str, Any]) -> None:
    """The fallback digits as IDX files, where torchvision's MNIST class looks for them (no download)."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        for kind, magic, key in (("images-idx3", 0x803, "x"), ("labels-idx1", 0x801, "y")):
            data = arrays[f"{split}_{key}"]
            header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in data.shape)
            (raw / f"{prefix}-{kind}-ubyte").write_bytes(header + data.tobytes())
            with gzip.open(raw / f"{prefix}-{kind}-ubyte.gz", "wb") as f:
                f.write(header + data.tobytes())


def tutorial_loop(learner: Learner, loader, accum: int, device: torch.device) -> None:
    """The tutorial's loop as published: loss / accum, step when (i + 1) % accum == 0."""
    model, opt, scaler, dtype = learner.model, learner.opt, learner.scaler, learner.dtype
    model.train()
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


def on_device(arrays: dict[str, Any], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n training images and labels on the device, as the train stage holds them."""
    return torch.from_numpy(arrays["train_x"][:n]).to(device), torch.from_numpy(arrays["train_y"][:n]).long().to(device)


def bench_spec(p: Params, device: torch.device, norm: str = "group", accum: int = 1) -> RunSpec:
    """A benchmark's run, resolved as the stages resolve a variant's: at accum 1 its micro-batch is its batch."""
    hw = Hardware.nominal("study" if device.type == "cuda" else "cpu")
    return declared_spec(p, hw, "bench", Variant(norm=norm, accum=accum, lr=1e-4, extra="seed"))


def setup(p: Params, device: torch.device, norm: str = "group", matmul_depthwise: bool = True) -> Learner:
    spec = bench_spec(p, device, norm)
    if matmul_depthwise:
        model = spec_model(spec, device=device)  # as the stages build it
    else:  # timm's model as the tutorial built it, whatever the device
        model = build_model(p.model, norm, spec.seed, device=device, matmul_depthwise=False)
    return Learner.of(model, spec, device)


def bench_loops(p, device, s, arrays, repeats: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, Subset
    from torchvision import datasets, transforms

    n, micro = s["images"], s["micro"]
    accum = accum_for(s["batch"], micro)
    images, labels = on_device(arrays, n, device)
    with tempfile.TemporaryDirectory() as tmp:
        write_idx(Path(tmp), arrays)
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (1.0,))])
        dataset = Subset(datasets.MNIST(tmp, train=True, download=False, transform=tf), range(n))
        loader = DataLoader(
            dataset,
            batch_size=micro,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            pin_memory=device.type == "cuda",
        )
        batches = schedule(n, micro, accum)
        ours, timm_model = setup(p, device, norm="batch"), setup(p, device, norm="batch", matmul_depthwise=False)
        arms = {  # the project as it trains; its loop on timm's model as the tutorial built it; the tutorial
            "ours": lambda: train_epoch(ours, images, labels, torch.randperm(n, device=device), batches),
            "loop": lambda: train_epoch(timm_model, images, labels, torch.randperm(n, device=device), batches),
            "tutorial": lambda: tutorial_loop(timm_model, loader, accum, device),
        }
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for fn in arms.values():
            fn()  # warm-up: workers started, kernels chosen
        for _ in range(repeats):  # interleaved, so drift on a noisy machine hits every arm alike
            for arm, fn in arms.items():
                times[arm] += median_time(fn, 1)
    speed = {arm: n / statistics.median(t) for arm, t in times.items()}
    return {
        "images": n,
        "micro_batch": micro,
        "accum": accum,
        "ours_images_per_s": speed["ours"],
        "loop_only_images_per_s": speed["loop"],
        "tutorial_images_per_s": speed["tutorial"],
        "ratio": speed["ours"] / speed["tutorial"],
        "loop_only_ratio": speed["loop"] / speed["tutorial"],
        "spread": {arm: [round(n / s, 1) for s in t] for arm, t in times.items()},
    }


def bench_accum(p, device, s, arrays, repeats: int) -> dict[str, Any]:
    n, batch = s["images"], s["batch"]
    images, labels = on_device(arrays, n, device)
    learner = setup(p, device)
    fns = {
        a: (
            lambda a=a: train_epoch(
                learner, images, labels, torch.arange(n, device=device), schedule(n, micro_batch_size(batch, a), a)
            )
        )
        for a in (1, 4, 8)
    }
    for fn in fns.values():
        fn()
    times: dict[int, list[float]] = {a: [] for a in fns}
    for _ in range(repeats):
        for a, fn in fns.items():
            times[a] += median_time(fn, 1)
    speed = {a: n / statistics.median(t) for a, t in times.items()}
    return {
        "images": n,
        "batch": batch,
        **{f"accum_{a}_images_per_s": v for a, v in speed.items()},
        "accum_4_over_1": speed[4] / speed[1],
        "accum_8_over_1": speed[8] / speed[1],
    }


def bench_sampler(p, device, s, arrays, repeats: int) -> dict[str, Any]:
    n, micro = s["images"], s["micro"]
    images, labels = on_device(arrays, n, device)
    learner = setup(p, device)
    batches = schedule(n, micro, 1)

    def plain() -> None:
        train_epoch(learner, images, labels, torch.arange(n, device=device), batches)

    def sampled() -> None:
        with MemorySampler(device.type, p.memory.interval_ms):
            plain()

    plain()
    without, with_ = [], []
    for _ in range(max(5, 3 * repeats)):  # a sub-1% effect needs more repeats than the others
        without += median_time(plain, 1)
        with_ += median_time(sampled, 1)
    a, b = statistics.median(without), statistics.median(with_)
    probe = MemorySampler(device.type, p.memory.interval_ms)
    start = time.perf_counter()
    for _ in range(50):
        probe.sample()
    per_sample = (time.perf_counter() - start) / 50  # the sampler's own cost, free of training noise
    return {
        "images": n,
        "interval_ms": p.memory.interval_ms,
        "repeats": len(without),
        "seconds_without": a,
        "seconds_with": b,
        "overhead": b / a - 1,
        "sample_seconds": per_sample,
        "duty_cycle": per_sample / (p.memory.interval_ms / 1000),
        "overhead_target": 0.01,
    }


def bench_planner(p, device: torch.device, s) -> dict[str, Any]:
    spec = sweep_spec(p, Hardware.nominal("study" if device.type == "cuda" else "cpu"), checkpointing=False)
    fit_points = [run_point(spec.at_micro(m), p.memory) for m in s["fit"]]
    fit = planner.line_through_points([r["micro_batch"] for r in fit_points], [r["peak_mib"] for r in fit_points])
    rows = []
    for micro in s["check"]:
        measured = run_point(spec.at_micro(micro), p.memory)["peak_mib"]
        predicted = planner.predict_mib(fit, micro)
        rows.append(
            {
                "micro_batch": micro,
                "measured_mib": measured,
                "predicted_mib": predicted,
                "predicted_over_measured": predicted / measured,
            }
        )
    return {"fit_on": s["fit"], "fit": fit.model_dump(mode="json"), "checks": rows}


def bench_ddp(repeats: int) -> dict[str, Any]:
    """benchmarks/ddp.py under torchrun, 2 processes on the CPU (gloo): its last line is the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [*cmd, "-m", "benchmarks.ddp", "--repeats", str(max(repeats, 5))],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


LINES = {  # what each benchmark prints, filled from its result
    "loop_vs_tutorial": "1. training, {images} images, micro-batch {micro_batch} x {accum}: this project "
    "{ours_images_per_s:.1f} img/s, the tutorial's DataLoader loop {tutorial_images_per_s:.1f} img/s: ratio "
    "{ratio:.2f}; of which the loop alone (on timm's model, as the tutorial's) {loop_only_images_per_s:.1f} img/s, "
    "ratio {loop_only_ratio:.2f}",
    "accumulation_cost": "2. accumulation at batch {batch}: accum 1 {accum_1_images_per_s:.1f}, accum 4 "
    "{accum_4_images_per_s:.1f}, accum 8 {accum_8_images_per_s:.1f} img/s; 4/1 {accum_4_over_1:.2f}, "
    "8/1 {accum_8_over_1:.2f}",
    "sampler_overhead": "3. memory sampler every {interval_ms} ms, median of {repeats}: {seconds_without:.3f} s "
    "without, {seconds_with:.3f} s with: overhead {overhead:+.2%} (target under 1%); one sample costs "
    "{sample_ms:.3f} ms = {duty_cycle:.3%} of the interval",
    "planner": "4. planner fit on {fit_on}: {fixed_mib:.0f} MiB + {per_sample_mib:.3f} MiB/sample",
    "planner_check": "   micro-batch {micro_batch}: measured {measured_mib:.0f} MiB, predicted {predicted_mib:.0f} "
    "MiB, predicted/measured {predicted_over_measured:.3f}",
    "ddp_no_sync": "5. DDP, {world} gloo processes, batch {batch} = {accum} x {micro_batch} x {world}: all-reduces "
    "per window {allreduces_per_window_no_sync:.0f} with no_sync, {allreduces_per_window_every_micro_batch:.0f} "
    "without; {seconds_per_window_no_sync:.3f} s against {seconds_per_window_every_micro_batch:.3f} s per window "
    "(without / with {every_micro_batch_over_no_sync:.2f})",
}


def line(key: str, r: dict[str, Any]) -> str:
    """The printed line of one benchmark (the planner's with one more per checked micro-batch)."""
    if key == "planner":
        checks = [LINES["planner_check"].format_map(c) for c in r["checks"]]
        return "\n".join([LINES[key].format_map(r | r["fit"]), *checks])
    if key == "sampler_overhead":
        r = r | {"sample_ms": r["sample_seconds"] * 1000}
    return LINES[key].format_map(r)


def main() -> None:
    parser = argparse.ArgumentParser(description="side-by-side benchmarks; prints a table, writes JSON")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/latest.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    p = params.load()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = SIZES[device.type]
    arrays, _ = mnist.fallback_sample()  # real digits, offline; speed does not depend on which
    if len(arrays["train_y"]) < s["images"]:
        reps = -(-s["images"] // len(arrays["train_y"]))
        arrays = {k: v.repeat(reps, axis=0) if k.startswith("train") else v for k, v in arrays.items()}
    machine = (
        torch.cuda.get_device_name(0) if device.type == "cuda" else f"{cpu_name()}, {torch.get_num_threads()} threads"
    )
    print(f"benchmarks on {machine} ({device.type}), model {p.model.name}, median of {args.repeats}", flush=True)
    results = {
        "machine": machine,
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    benches = (  # (key in the JSON and LINES, the measurement)
        ("loop_vs_tutorial", lambda: bench_loops(p, device, s, arrays, args.repeats)),
        ("accumulation_cost", lambda: bench_accum(p, device, s, arrays, args.repeats)),
        ("sampler_overhead", lambda: bench_sampler(p, device, s, arrays, args.repeats)),
        ("planner", lambda: bench_planner(p, device, s)),
        ("ddp_no_sync", lambda: bench_ddp(args.repeats)),
    )
    for key, bench in benches:
        results[key] = bench()
        print(line(key, results[key]), flush=True)
    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
