"""Bad input refused by a stage run alone, as `dvc repro <stage>` runs it: one line naming the key and the
value, a non-zero exit, no traceback, nothing written. A refusal needs no training, so each takes seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gradaccum import mnist, params

ROOT = Path(__file__).resolve().parent.parent
VIT = "model.name=vit_tiny_patch16_224"  # a timm model whose forward cannot take 28x28 single-channel images


def run_stage(workdir: Path, stage: str, changes: list[str]) -> subprocess.CompletedProcess[str]:
    """`python -m stages.<stage>` in workdir with params.yaml changed, the CPU hardware record and a dataset
    of 100 training images in place."""
    values = params.read(workdir / "params.yaml")
    (workdir / "params.yaml").write_text(yaml.safe_dump(params.assign(values, changes), sort_keys=False))
    (workdir / "data").mkdir(exist_ok=True)
    if stage != "hardware":
        (workdir / "data/hardware.json").write_text(json.dumps({"device": "cpu", "scale": "cpu"}))
    images, labels = np.zeros((100, 28, 28), np.uint8), np.zeros(100, np.uint8)
    mnist.save({"train_x": images, "train_y": labels, "test_x": images, "test_y": labels}, workdir / "data/dataset.npz")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", f"stages.{stage}"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 1
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr  # one line
    assert result.stderr.startswith("error: params.yaml: ") and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ([VIT, "scales.cpu.batch=64"], "model.name = 'vit_tiny_patch16_224' cannot take"),
        ([], "scales.cpu.batch = 256 is not allowed; data/dataset.npz holds 100 training images"),
    ],
    ids=["model that cannot take the images", "batch larger than the data"],
)
def test_the_sweep_stage_refuses_in_one_line_before_any_point(workdir: Path, changes: list[str], expected: str) -> None:
    result = run_stage(workdir, "sweep", changes)
    assert_refused(result, expected)
    assert "sweep: micro-batch" not in result.stdout  # no point ran
    assert not (workdir / "reports").exists()  # nothing written


def test_the_hardware_stage_first_in_every_run_refuses_a_model_that_cannot_take_the_images(workdir: Path) -> None:
    result = run_stage(workdir, "hardware", [VIT])
    assert_refused(result, "model.name = 'vit_tiny_patch16_224' cannot take the data's 28x28 single-channel images")
    assert not (workdir / "data/hardware.json").exists()
