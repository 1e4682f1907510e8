"""The device check and its twin: scripts/device_check.sh run here, on the CPU, in an environment shaped like the lent
GPU machine's (tests/device_twin/sitecustomize.py: the packages it lacks refused unless the bundle brings them, torch
2.11's CUDA autocast lists, no network; a fake nvidia-smi; OUT held to the 8 files that come back). The new script
passes it; today's scripts/gpu_check.sh stops at its first import. The bundle's pieces are tested fast below."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gradaccum import device

ROOT = Path(__file__).resolve().parent.parent
TWIN = ROOT / "tests" / "device_twin"
TINY = [
    "scale=cpu",  # the fake nvidia-smi lists an H100 that torch cannot use: set by hand, the CPU scale runs
    "scales.cpu.train_samples=64",
    "scales.cpu.test_samples=32",
    "scales.cpu.batch=32",
    "scales.cpu.epochs=1",
    "scales.cpu.sweep_micro_batches=[8,16]",
]
FAKE_SMI = """#!/bin/sh
case "$1" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a00)" ;;
  --query-gpu=*) echo "name, driver_version"; echo "NVIDIA H100 80GB HBM3, 580.95.05" ;;
  *) echo "+---- NVIDIA-SMI 580.95.05 (device twin) ----+" ;;
esac
"""
RETURNED = 8  # files that come back from $OUT
RETURNED_MIB = 16  # each at most


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The bundle, built by its command for this Python (the device's is 3.12), and the twin's environment."""
    if not (device.FASHION / device.DATA_FILES[0]).is_file():
        pytest.skip(f"{device.FASHION} missing: apt-get install dataset-fashion-mnist")
    tmp = tmp_path_factory.mktemp("twin")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [sys.executable, "-m", "gradaccum.device", "bundle", "--dest", str(tmp / "device-bundle"), "--python", python],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (tmp / "bin").mkdir()
    (tmp / "bin/nvidia-smi").write_text(FAKE_SMI)
    (tmp / "bin/nvidia-smi").chmod(0o755 | stat.S_IEXEC)
    return {
        **os.environ,
        "PATH": f"{tmp / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin",
        "PYTHONPATH": str(TWIN),
        "TWIN_BUNDLE_SITE": str(tmp / "device-bundle/site"),
        "TWIN_LACKS": ",".join(device.LACKS),
        "DEVICE_BUNDLE": str(tmp / "device-bundle"),
        "PYTHON": sys.executable,
        "TMP": str(tmp),
    }


@pytest.mark.slow
def test_the_device_check_passes_its_twin(twin: dict[str, str]) -> None:
    out = Path(twin["TMP"]) / "out"
    sets = [arg for s in TINY for arg in ("-S", s)]
    ran = subprocess.run(
        ["bash", str(ROOT / "scripts/device_check.sh"), str(out), *sets],
        capture_output=True,
        text=True,
        env=twin,
        check=False,
        timeout=900,
    )
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    files = sorted(out.iterdir())
    assert len(files) <= RETURNED and all(f.is_file() for f in files), files
    assert all(f.stat().st_size <= RETURNED_MIB * 2**20 for f in files)
    status = {p["part"]: p for p in json.loads((out / "status.json").read_text())["parts"]}
    assert list(status) == ["preflight", "memory", "trace", "training"], status
    assert status["preflight"]["ok"] and status["memory"]["ok"] and status["training"]["ok"], status
    # No CUDA driver here: the native trace fails, in one line, and the emulated one stands.
    assert not status["trace"]["ok"] and "hasPrimaryContext" in status["trace"]["line"], status["trace"]
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["step"]["device"] == "cpu" and preflight["step"]["loss"] > 0
    assert "lacks rms_norm" in preflight["autocast_lists"] and "H100" in preflight["nvidia_smi_L"]
    assert preflight["packages"]["pydantic"] == device.pins(ROOT / "requirements.lock")["pydantic"]
    assert preflight["pydantic_from"] == twin["TWIN_BUNDLE_SITE"]  # the bundle's, not this venv's
    memory = json.loads((out / "memory.json").read_text())
    import yaml

    variants = yaml.safe_load((ROOT / "params.yaml").read_text())["variants"]
    assert list(memory["variants"]) == list(variants)
    for v, packed in memory["variants"].items():
        record = json.loads(packed["metrics.json"])
        assert record["completed"] and record["batch"] == 32 and record["memory"]["rss_peak_mib"] > 0, v
        assert {"epochs.tsv", "steps.tsv", "memory.csv", "nvidia-smi.txt"} <= set(packed), v
    assert memory["provenance.json"]["dataset"] == "fashion_mnist" and memory["provenance.json"]["kind"] == "local"
    assert {r["variant"] for r in memory["trace.json"]["rows"]} == set(variants)  # the carried prediction
    compared = (out / "predicted_vs_measured.txt").read_text()
    assert compared.startswith("Data: Fashion-MNIST standing in for MNIST") and "No GPU ran the study here" in compared
    assert preflight["bundle"]["data"]["stands_in_for"] == "MNIST (same shapes)"
    traced = json.loads((out / "device_trace.json").read_text())["rows"]
    emulated = [r for r in traced if not r["native"]]
    assert len(emulated) == len(variants) and all(r["peak_mib"] > 0 for r in emulated)
    autocast = [r["autocast_policy"] for r in emulated if r["amp"] != "float32"]
    assert autocast and all("lacks rms_norm, and this step calls none" in a for a in autocast)
    assert all("hasPrimaryContext" in r["failed"] for r in traced if r["native"])
    training = json.loads((out / "training.json").read_text())
    assert list(training["variants"]) == ["baseline", "accumulation"]
    assert "== done in" in (out / "log.txt").read_text()
    dest = Path(twin["TMP"]) / "unpacked" / "gpu-run"
    subprocess.run([sys.executable, "-m", "gradaccum.device", "unpack", str(out), str(dest)], cwd=ROOT, check=True)
    assert (dest / "variants/accumulation/metrics.json").is_file() and (dest / "trace.json").is_file()
    assert (dest / "training/variants/baseline/epochs.tsv").is_file() and (dest / "status.json").is_file()


@pytest.mark.slow
def test_todays_gpu_check_fails_the_twin_at_its_first_import(twin: dict[str, str], tmp_path: Path) -> None:
    ran = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "o"), *[a for s in TINY for a in ("-S", s)]],
        capture_output=True,
        text=True,
        env=twin,
        check=False,
        timeout=300,
    )
    assert ran.returncode != 0 and "No module named 'pydantic' (device twin: the device lacks it)" in ran.stderr


def test_the_bundle_takes_the_locks_versions() -> None:
    pins = device.pins(ROOT / "requirements.lock")
    assert list(pins) == list(device.BUNDLED)
    lock = (ROOT / "requirements.lock").read_text()
    assert f"pydantic=={pins['pydantic']}\n" in lock and f"pydantic_core=={pins['pydantic_core']}\n" in lock


def test_the_bundle_refuses_a_data_folder_without_the_four_files(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--data .* lacks train-images-idx3-ubyte.gz"):
        device.build_bundle(tmp_path / "b", "3.12", tmp_path, ROOT / "params.yaml", [])
    assert not (tmp_path / "b").exists()


def packed_record(stage_seconds: float, train_seconds: float) -> dict[str, str]:
    record = {"completed": True, "stage_seconds": stage_seconds, "train_seconds": train_seconds}
    return {"metrics.json": json.dumps(record)}


def test_epochs_that_fit_leave_a_third_to_spare(tmp_path: Path) -> None:
    """Start-up 10 s, an epoch 5 s (the slower of the two): 200 s for two runs is 75 s each with a third spare,
    (75 - 10) // 5 = 13 epochs, held to the study's 10; 60 s gives (22.6 - 10) // 5 = 2."""
    variants = {"baseline": packed_record(15, 5), "accumulation": packed_record(14, 4)}
    device.write_json(tmp_path / "memory.json", {"variants": variants})
    assert device.epochs_that_fit(tmp_path, 200) == 10
    assert device.epochs_that_fit(tmp_path, 60) == 2
    assert device.epochs_that_fit(tmp_path, 20) == 0
    device.write_json(tmp_path / "memory.json", {"variants": {"baseline": variants["baseline"]}})
    assert device.epochs_that_fit(tmp_path, 200) == 0  # accumulation was not timed


def test_a_failed_part_is_one_line_and_the_next_is_recorded_after_it(tmp_path: Path) -> None:
    log = tmp_path / "part.log"
    log.write_text("working\nTraceback ...\nRuntimeError: CUDA error: out of memory\n\n")
    device.record_status(tmp_path, "memory", 1, 12.34, log)
    log.write_text("fine\n")
    device.record_status(tmp_path, "trace", 0, 3, log)
    device.record_status(tmp_path, "training", 124, 50, log)
    parts = json.loads((tmp_path / "status.json").read_text())["parts"]
    assert parts[0] == {
        "part": "memory", "ok": False, "exit": 1, "seconds": 12.3, "line": "RuntimeError: CUDA error: out of memory"
    }  # fmt: skip
    assert parts[1] == {"part": "trace", "ok": True, "exit": 0, "seconds": 3}
    assert parts[2]["line"] == "ran past its time (timeout); last line: fine"
