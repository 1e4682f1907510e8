"""Every row of the README's table of bad input, as a newcomer meets it: each example run through every stage the
table names, alone (the stage's `__main__`, as `python -m stages.<stage>` and so `dvc repro <stage>` runs it), and
through a whole `dvc repro` of a fresh copy. Each must stop with one line naming the key and the value, exit status
65, no traceback, and nothing of that stage written. A refusal needs no training, so each takes seconds; the table
is parsed from README.md, so the README and the code cannot drift apart.

The stages alone run in this process (runpy), not in a child: the same code from the module's `if __name__` on,
without importing torch and timm again (4 s a stage, 35 runs). The whole-`dvc repro` runs below start the stages as
DVC does, in their own processes, and check the same one line there.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import yaml
from conftest import copy_of_the_tree

from gradaccum import mnist, params
from gradaccum.outputs import write_json
from gradaccum.refusal import REFUSED

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["hardware", "download", "sweep", "gradcheck", "speed", "trace", "train", "report"]  # dvc repro's, pinned below
HEADER = "| Bad input | Example | Refused first by | Also by, run alone |"
IMAGES = 300  # in the stage-alone fixture's data/dataset.npz: the default batch (256) fits, 6000 does not


class Row(NamedTuple):
    changes: list[str]
    first: str
    also: list[str]


def readme_rows() -> list[Row]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        _, example, first, also = (cell.strip() for cell in line.strip("|").split("|"))
        stage = re.findall(r"`(\w+)`", first)[0]
        stages = re.findall(r"`(\w+)`", also) if also != "every stage" else [s for s in ORDER if s != stage]
        rows.append(Row(example.strip("`").split(), stage, stages))
    return rows


ROWS = readme_rows()


def example_id(row: Row) -> str:
    return " ".join(row.changes)


def stage_outs(stage: str, variant: str = "accumulation") -> list[str]:
    """What the stage writes, from dvc.yaml (the train stage's for one variant)."""
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    spec = spec.get("do", spec)
    outs = [o for key in ("outs", "plots", "metrics") for o in spec.get(key, [])]
    outs = [next(iter(o)) if isinstance(o, dict) else o for o in outs]
    return [o.replace("${key}", variant) for o in outs]


CPU = {"name": "a CPU", "native_bfloat16": True}  # the hardware record's CPU facts the stages read


def run_stage(workdir: Path, stage: str, changes: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """The stage's `__main__` in workdir (the cwd) with params.yaml changed, the CPU hardware record (made by the
    hardware stage otherwise) and a dataset of IMAGES training images (made by download otherwise) in place;
    returns its exit status. What it prints, capfd holds."""
    values = params.read(workdir / "params.yaml")
    (workdir / "params.yaml").write_text(yaml.safe_dump(params.assign(values, changes), sort_keys=False))
    (workdir / "data").mkdir(exist_ok=True)
    if ORDER.index(stage) > ORDER.index("hardware"):
        write_json(workdir / "data/hardware.json", {"format": 1, "device": "cpu", "scale": "cpu", "cpu": CPU})
    if ORDER.index(stage) > ORDER.index("download"):
        images, labels = np.zeros((IMAGES, 28, 28), np.uint8), np.zeros(IMAGES, np.uint8)
        arrays = {"train_x": images, "train_y": labels, "test_x": images, "test_y": labels}
        mnist.save(arrays, workdir / "data/dataset.npz")
    monkeypatch.setattr(sys, "argv", [f"stages/{stage}.py", *(["accumulation"] if stage == "train" else [])])
    monkeypatch.setenv("MNIST_MIRRORS", "http://127.0.0.1:9/")
    monkeypatch.delitem(sys.modules, f"stages.{stage}", raising=False)  # imported by another test: run it afresh
    with pytest.raises(SystemExit) as stopped:  # a stage that does not stop at all fails here: DID NOT RAISE
        runpy.run_module(f"stages.{stage}", run_name="__main__", alter_sys=True)
    return stopped.value.code


def refusal_line(output: str, changes: list[str]) -> str:
    """The one `error: ` line, naming the last change's key and value; asserts there is exactly one."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    key, value = changes[-1].split("=", 1)
    assert key in errors[0] and value.lower() in errors[0].lower(), errors[0]
    assert "Traceback" not in output, output
    return errors[0]


def skip_where_a_gpu_runs(row: Row) -> None:
    if "scale=study" in row.changes and torch.cuda.is_available():
        pytest.skip("the study scale is allowed on this machine: it has a CUDA GPU")


def test_the_readme_table_covers_every_stage_and_names_real_ones() -> None:
    assert len(ROWS) >= 8
    named = {row.first for row in ROWS} | {s for row in ROWS for s in row.also}
    assert named <= set(ORDER)
    assert set(ORDER) <= named  # every stage refuses something when run alone


@pytest.mark.parametrize(
    ("row", "stage"),
    [(row, stage) for row in ROWS for stage in [row.first, *row.also]],
    ids=[f"{example_id(row)} @ {stage}" for row in ROWS for stage in [row.first, *row.also]],
)
def test_a_stage_run_alone_refuses_in_one_line(
    workdir: Path, row: Row, stage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    skip_where_a_gpu_runs(row)
    status = run_stage(workdir, stage, row.changes, monkeypatch)
    out, err = capfd.readouterr()
    assert status == REFUSED, out + err
    assert err.strip().count("\n") == 0, err  # the one line is all it says on stderr
    refusal_line(err, row.changes)
    assert [o for o in stage_outs(stage) if (workdir / o).exists()] == []  # nothing of it written


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files as a clone has them (no reference reports), with no outputs: `dvc repro` runs all."""
    base = copy_of_the_tree(tmp_path_factory.mktemp("fresh"))
    subprocess.run(["git", "init", "-q"], cwd=base, check=True)
    return base


@pytest.mark.parametrize("row", ROWS, ids=[example_id(row) for row in ROWS])
def test_dvc_repro_stops_in_the_first_stage_that_can_tell(fresh_copy: Path, tmp_path: Path, row: Row) -> None:
    """On a fresh copy, with the mirrors closed (the fallback digits): the stages before the named one run, it
    refuses in one line, nothing after it runs, and none of its outputs is there."""
    skip_where_a_gpu_runs(row)
    repo = tmp_path / "repo"
    shutil.copytree(fresh_copy, repo, symlinks=True)
    values = params.read(repo / "params.yaml")
    (repo / "params.yaml").write_text(yaml.safe_dump(params.assign(values, row.changes), sort_keys=False))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MNIST_MIRRORS": "http://127.0.0.1:9/",
        "DVC_NO_ANALYTICS": "1",
    }
    result = subprocess.run(
        ["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.findall(r"Running stage '([^']+)'", output) == ORDER[: ORDER.index(row.first) + 1], output
    refusal_line(output, row.changes)
    assert f"failed to reproduce '{row.first}'" in output and f"exited with {REFUSED}" in output
    assert [o for o in stage_outs(row.first) if (repo / o).exists()] == []


def test_dvc_runs_the_stages_in_the_order_the_table_assumes() -> None:
    """A fresh clone's `dvc repro` order: hardware, then download, then the stages that read the data."""
    from dvc.repo import Repo
    from dvc.repo.reproduce import get_active_graph, plan_repro

    with Repo(str(ROOT)) as repo:
        planned = [stage.addressing.split("@")[0] for stage in plan_repro(get_active_graph(repo.index.graph))]
    assert list(dict.fromkeys(planned)) == ORDER
