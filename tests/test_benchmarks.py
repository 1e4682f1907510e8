"""The benchmark's stand-in for the tutorial's data path reads back the same digits through torchvision."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from benchmarks import cross_cpu
from benchmarks.run import tutorial_loop, write_idx
from gradaccum import params
from gradaccum.loop import Learner, normalize
from gradaccum.records import VariantRecord
from gradaccum.report.results import seed_mean


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
    tutorial_loop(Learner(model, opt, scaler, None), DataLoader(ds, batch_size=5), 2, torch.device("cpu"))
    assert not torch.equal(before, model[1].weight)


def test_ddp_benchmark_counts_one_allreduce_per_window_with_no_sync() -> None:
    """benchmarks/ddp.py under torchrun (2 gloo processes, the real model): the figures make bench prints."""
    from benchmarks.run import bench_ddp

    r = bench_ddp(1)
    assert r["world"] == 2 and r["accum"] == 4 and r["micro_batch"] == 8
    assert r["allreduces_per_window_no_sync"] == 1 and r["allreduces_per_window_every_micro_batch"] == 4
    assert r["seconds_per_window_no_sync"] > 0 and r["seconds_per_window_every_micro_batch"] > 0


def test_every_benchmark_line_prints_the_recorded_figures() -> None:
    """Each printed line carries the result's own figures (checked on the committed CPU results): the ratio
    or count a reader takes from it, not only text that formats."""
    import json

    from benchmarks.run import LINES, line

    recorded = json.loads(sorted(Path(__file__).parent.parent.glob("benchmarks/results/cpu-*.json"))[-1].read_text())
    shown = {  # per benchmark, figures its line must show, formatted as a reader sees them
        "loop_vs_tutorial": lambda r: [f"ratio {r['ratio']:.2f}", f"ratio {r['loop_only_ratio']:.2f}"],
        "accumulation_cost": lambda r: [f"4/1 {r['accum_4_over_1']:.2f}", f"8/1 {r['accum_8_over_1']:.2f}"],
        "sampler_overhead": lambda r: [f"overhead {r['overhead']:+.2%}", f"{r['duty_cycle']:.3%} of the interval"],
        "planner": lambda r: (
            [f"{r['fit']['per_sample_mib']:.3f} MiB/sample"]
            + [f"predicted/measured {c['predicted_over_measured']:.3f}" for c in r["checks"]]
        ),
        "ddp_no_sync": lambda r: [f"per window {r['allreduces_per_window_no_sync']:.0f} with no_sync"],
    }
    assert set(shown) == set(LINES) - {"planner_check"}
    for key, figures in shown.items():
        text = line(key, recorded[key])
        assert all(f in text for f in figures(recorded[key])), (key, text)


def test_the_planner_benchmark_holds_the_fit_against_points_it_did_not_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """Points peaking at 500 + 2 MiB/sample: fit on 8 and 16, checked at 32 measured at 540 MiB, where the line
    predicts 564: predicted/measured 564 / 540 = 1.0444."""
    from benchmarks import run

    peaks = {8: 516.0, 16: 532.0, 32: 540.0}
    monkeypatch.setattr(
        run, "run_point", lambda spec, memory: {"micro_batch": spec.micro_batch, "peak_mib": peaks[spec.micro_batch]}
    )
    p = params.load(Path(__file__).resolve().parent.parent / "params.yaml", model_names=False)
    result = run.bench_planner(p, torch.device("cpu"), {"fit": [8, 16], "check": [32]})
    assert result["fit"]["fixed_mib"] == pytest.approx(500.0) and result["fit"]["per_sample_mib"] == pytest.approx(2.0)
    [check] = result["checks"]
    assert check["predicted_mib"] == pytest.approx(564.0) and check["measured_mib"] == 540.0
    assert check["predicted_over_measured"] == pytest.approx(564 / 540)
    assert "predicted/measured 1.044" in run.line("planner", result)


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


def test_cross_cpu_moves_a_variant_by_its_seed_by_seed_change(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The committed three-seed reference against a copy with one seed's baseline loss raised by 0.1: that variant
    moves by 0.1 against its seed spread, the others by nothing, and the split's lr part by a third of it."""
    ref = Path(__file__).resolve().parent.parent / "reports/reference/cpu-2026-12-06-seeds3"
    copy = tmp_path / "b"
    shutil.copytree(ref, copy, ignore=shutil.ignore_patterns("*.png", "*.html", "live", "*.tsv", "*.csv"))
    path = copy / "variants/baseline/metrics.json"
    record = VariantRecord.read(path)
    seeds = [record.seeds[0].model_copy(update={"final_train_loss": record.seeds[0].final_train_loss + 0.1})]
    path.write_text(record.model_copy(update={"seeds": seeds + record.seeds[1:]}).model_dump_json())
    a, b = cross_cpu.records(ref), cross_cpu.records(copy)
    assert cross_cpu.compare(a["groupnorm"], b["groupnorm"]).endswith("| 0.0000 / 0.000 | 0.1664 | 0.00 |")
    # seed 99's 2.1728 + 0.1 stays inside the other seeds' range (2.0804 to 2.3473): the spread is unchanged
    assert cross_cpu.compare(a["baseline"], b["baseline"]).endswith("| 0.1000 / 0.000 | 0.2669 | 0.37 |")
    base = seed_mean(a["baseline"], "final_train_loss")
    assert seed_mean(b["baseline"], "final_train_loss") == pytest.approx(base + 0.1 / 3)
