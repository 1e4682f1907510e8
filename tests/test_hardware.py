"""A GPU host that cannot train says so: nvidia-smi lists a GPU, torch cannot use it, and the hardware stage refuses
in one line naming the GPU, the driver, torch's CUDA and the fix, instead of training the CPU scale in silence."""

from __future__ import annotations

import json
import os
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gradaccum import params
from gradaccum.refusal import REFUSED

ROOT = Path(__file__).resolve().parent.parent
# What nvidia-smi prints for `--query-gpu=name,driver_version --format=csv,nounits` (FAKE_DRIVER picks the
# driver), or, with FAKE_DRIVER=none, what it prints where no driver is loaded (exit status 9).
FAKE = """#!/bin/sh
if [ "$FAKE_DRIVER" = none ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2; exit 9
fi
echo "name, driver_version"
echo "NVIDIA H100 80GB HBM3, $FAKE_DRIVER"
"""


@pytest.fixture
def gpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine whose nvidia-smi lists an H100 while torch sees no CUDA device (as here), torch built for CUDA 13."""
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return script.parent


def hardware(workdir: Path, changes: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """The hardware stage's `__main__` in workdir with params.yaml changed; its exit status (0: it finished)."""
    values = params.read(workdir / "params.yaml")
    (workdir / "params.yaml").write_text(yaml.safe_dump(params.assign(values, changes), sort_keys=False))
    monkeypatch.setattr(sys, "argv", ["stages/hardware.py"])
    monkeypatch.delitem(sys.modules, "stages.hardware", raising=False)
    try:
        runpy.run_module("stages.hardware", run_name="__main__", alter_sys=True)
    except SystemExit as stopped:
        return stopped.code
    return 0


def test_an_old_driver_is_refused_in_one_line_with_the_fix(
    workdir: Path, gpu_host: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_DRIVER", "550.54.15")
    assert hardware(workdir, [], monkeypatch) == REFUSED
    out, err = capfd.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith("error: nvidia-smi lists NVIDIA H100 80GB HBM3 (driver 550.54.15) but torch")
    assert "built for CUDA 13.0, which needs driver 580 or newer" in line
    assert "download.pytorch.org/whl/cu126" in line and "scale=cpu" in line
    assert not (workdir / "data/hardware.json").exists() and "Traceback" not in out + err


def test_a_driver_new_enough_points_at_the_device_files(
    workdir: Path, gpu_host: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_DRIVER", "580.95.05")
    assert hardware(workdir, ["scale=study"], monkeypatch) == REFUSED
    [line] = capfd.readouterr().err.strip().splitlines()
    assert "(driver 580.95.05)" in line and "--gpus all" in line and "CUDA_VISIBLE_DEVICES" in line


def test_scale_cpu_set_by_hand_still_runs(
    workdir: Path, gpu_host: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_DRIVER", "550.54.15")
    assert hardware(workdir, ["scale=cpu"], monkeypatch) == 0
    assert json.loads((workdir / "data/hardware.json").read_text())["scale"] == "cpu"


def test_no_driver_at_all_is_a_cpu_machine(
    workdir: Path, gpu_host: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """nvidia-smi installed without a driver it can talk to lists no GPU: the CPU scale, as on any CPU machine."""
    monkeypatch.setenv("FAKE_DRIVER", "none")
    assert hardware(workdir, [], monkeypatch) == 0
    assert json.loads((workdir / "data/hardware.json").read_text())["scale"] == "cpu"


def test_the_container_entrypoint_says_the_same(tmp_path: Path, gpu_host: Path) -> None:
    """The image's entrypoint, in the checkout, with that nvidia-smi on PATH: the same line, before DVC starts."""
    path = f"{gpu_host}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin"
    ran = subprocess.run(
        ["sh", str(ROOT / "scripts/container_entrypoint.sh"), "echo", "dvc ran"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": path, "FAKE_DRIVER": "550.54.15", "CUDA_VISIBLE_DEVICES": ""},
        check=False,
        timeout=120,
    )
    assert ran.returncode == 0 and ran.stdout == "dvc ran\n"
    [line] = ran.stderr.strip().splitlines()
    assert line.startswith("note: nvidia-smi lists NVIDIA H100 80GB HBM3 (driver 550.54.15) but torch")
    assert f"built for CUDA {torch.version.cuda}" in line
