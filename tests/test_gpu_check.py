"""scripts/gpu_check.sh on the CPU path, at a tiny scale: every stage in order, everything in one folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "scale=cpu",
    "scales.cpu.train_samples=64",
    "scales.cpu.test_samples=32",
    "scales.cpu.batch=32",
    "scales.cpu.epochs=1",
    "scales.cpu.sweep_micro_batches=[8,16]",
    "memory.sweep_steps=1",
]


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu_path(tmp_path: Path, fashion_dir: Path) -> None:
    out = tmp_path / "out"
    before = (ROOT / "params.yaml").read_bytes()
    sets = [arg for s in [*TINY, "data.dataset=fashion_mnist"] for arg in ("-S", s)]
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(out), str(fashion_dir), *sets],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    reports = out / "reports"
    assert (reports / "report.html").is_file() and (reports / "report.md").is_file()
    for variant in ("baseline", "accumulation", "groupnorm", "accum_batchnorm"):
        metrics = json.loads((reports / "variants" / variant / "metrics.json").read_text())
        assert metrics["completed"] and metrics["train_samples"] == 64
        assert (reports / "variants" / variant / "nvidia-smi.txt").is_file()
        assert not (reports / "variants" / variant / "memory_snapshot.pickle").exists()  # CUDA only
    for variant in ("baseline", "accumulation"):  # asked for; the stage records it on a GPU alone
        assert f"stages.train {variant} --memory-snapshot reports/variants/{variant}/memory_snapshot.pickle" in (
            result.stdout
        )
    assert (reports / "speed.json").is_file() and (reports / "trace.json").is_file()  # the whole study's outputs
    assert "## Predicted without a GPU: the traced peak" in (reports / "report.md").read_text()
    table = (reports / "predicted_vs_measured.txt").read_text()  # printed last; on the CPU, predictions only
    assert "nvidia-smi, predicted (GiB)" in table and "No GPU ran the study here: predictions only." in table
    assert table in result.stdout
    provenance = json.loads((reports / "provenance.json").read_text())
    assert provenance["kind"] == "local" and provenance["dataset"] == "fashion_mnist"
    assert (ROOT / "params.yaml").read_bytes() == before  # the checkout's params are untouched
    assert "dataset: fashion_mnist" in (reports / "params.yaml").read_text()


def test_gpu_check_rejects_a_bad_param_before_any_work(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "o"), "-S", "accum=0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
        timeout=300,
    )
    assert result.returncode != 0 and "accum = 0 is not allowed" in result.stderr
    assert not (tmp_path / "o" / "work" / "data").exists()


def test_gpu_check_refuses_the_checkout_as_out(tmp_path: Path) -> None:
    """OUT/reports is replaced at the end: OUT = the checkout would delete its reports (references included)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/gpu_check.sh").write_text((ROOT / "scripts/gpu_check.sh").read_text())
    (tmp_path / "reports/reference").mkdir(parents=True)
    (tmp_path / "reports/reference/report.md").write_text("keep me")
    result = subprocess.run(
        ["bash", str(tmp_path / "scripts/gpu_check.sh"), "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
        timeout=60,
    )
    assert result.returncode == 2 and "OUT is this checkout" in result.stderr
    assert (tmp_path / "reports/reference/report.md").read_text() == "keep me" and not (tmp_path / "work").exists()
