"""Shared fixtures. Tests run from anywhere; stage code expects the repository root as cwd."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_MNIST = Path(os.environ.get("SHARED_MNIST", ROOT.parent / "shared" / "mnist"))
FASHION = Path("/usr/share/datasets/fashion-mnist")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs the real pipeline end to end (minutes)")


@pytest.fixture
def shared_mnist() -> Path:
    if not (SHARED_MNIST / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST test files not found in {SHARED_MNIST} (a user's clone has no ../shared/mnist)")
    return SHARED_MNIST


@pytest.fixture
def fashion_dir() -> Path:
    if not (FASHION / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"{FASHION} missing: apt-get install dataset-fashion-mnist")
    return FASHION


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp folder holding the repo's params.yaml, as cwd, for stage code that reads relative paths."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def copy_of_the_tree(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked, and new ones git does not ignore), without the
    committed reference reports: no pipeline output, so `dvc repro` there runs every stage."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file() and not name.startswith("reports/reference/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest
