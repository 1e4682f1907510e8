"""The benchmark's stand-in for the tutorial's data path reads back the same digits through torchvision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from benchmarks.run import tutorial_loop, write_idx
from gradaccum.loop import normalize


def test_torchvision_mnist_reads_the_written_idx_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "train_x": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "train_y": np.arange(20, dtype=np.uint8) % 10,
        "test_x": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "test_y": np.arange(5, dtype=np.uint8),
    }
    write_idx(tmp_path, arrays)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (1.0,))])
    ds = datasets.MNIST(str(tmp_path), train=True, download=False, transform=tf)
    x, y = ds[3]
    assert len(ds) == 20 and y == 3
    assert torch.allclose(x, normalize(torch.from_numpy(arrays["train_x"][3:4]))[0], atol=1e-6)  # same inputs

    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    before = model[1].weight.clone()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    tutorial_loop(model, opt, scaler, DataLoader(ds, batch_size=5), 2, torch.device("cpu"), None)
    assert not torch.equal(before, model[1].weight)


def test_ddp_benchmark_counts_one_allreduce_per_window_with_no_sync() -> None:
    """benchmarks/ddp.py under torchrun (2 gloo processes, the real model): the figures make bench prints."""
    from benchmarks.run import bench_ddp

    r = bench_ddp(1)
    assert r["world"] == 2 and r["accum"] == 4 and r["micro_batch"] == 8
    assert r["allreduces_per_window_no_sync"] == 1 and r["allreduces_per_window_every_micro_batch"] == 4
    assert r["seconds_per_window_no_sync"] > 0 and r["seconds_per_window_every_micro_batch"] > 0


def test_every_benchmark_line_formats_a_recorded_result() -> None:
    """The printed lines name only keys the benchmarks write (checked on the committed CPU results)."""
    import json

    from benchmarks.run import LINES, line

    recorded = json.loads(sorted(Path(__file__).parent.parent.glob("benchmarks/results/cpu-*.json"))[-1].read_text())
    for key in (k for k in LINES if k != "planner_check"):
        text = line(key, recorded[key])
        assert text[0].isdigit() and "{" not in text, text


def test_repro_breakdown_splits_the_computation_from_the_overhead(workdir: Path) -> None:
    from test_report import fixture_run

    from benchmarks.repro import breakdown, table

    metrics = fixture_run(workdir, "cpu")
    walls = {"hardware": 4.0, "download": 3.0, "sweep": 31.0, "gradcheck": 13.0}
    walls |= {f"train@{n}": m["stage_seconds"] + 1 for n, m in metrics.items()} | {"report": 10.0}
    total = sum(walls.values()) + 2
    result = breakdown(workdir, walls, total)
    work = 6 * 1.5 + 7.0 + sum(m["train_seconds"] for m in metrics.values())  # sweep points, gradcheck, loops
    assert result["computation_s"] == pytest.approx(work) and result["overhead_s"] == pytest.approx(
        total - work, abs=0.1
    )
    assert result["by_stage"]["report"] == {"wall_s": 10.0, "process_s": None, "computation_s": 0}
    assert result["by_stage"]["sweep"]["process_s"] == 30.0
    printed = table(result)
    assert f"overhead {total - work:.0f} s = {(total - work) / total:.0%}" in printed and "train@baseline" in printed
