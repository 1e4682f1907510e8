"""A stage run alone with an input missing or unreadable (a refused `dvc repro` has already removed the outputs of the
stage it stopped in) says so in one line naming the file and the command that makes it, exit status 65, no traceback,
before any long work. Every stage's every input, each missing and each damaged; stages run in this process (runpy)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gradaccum import mnist, params
from gradaccum.loop import EPOCH_COLUMNS, STEP_COLUMNS
from gradaccum.memory import TIMELINE_COLUMNS
from gradaccum.outputs import write_json
from gradaccum.records import CudnnRun, MemoryPeaks, VariantRecord
from gradaccum.refusal import REFUSED

TINY = ["scales.cpu.train_samples=64", "scales.cpu.test_samples=32", "scales.cpu.batch=32", "scales.cpu.epochs=1"]
HARDWARE = {"format": 1, "device": "cpu", "scale": "cpu", "cpu": {"name": "test", "cores": 2, "native_bfloat16": False}}
# What each stage reads that another stage makes, and that stage (what the line must tell the user to run).
INPUTS = {
    "sweep": {"data/hardware.json": "hardware", "data/dataset.npz": "download"},
    "gradcheck": {"data/hardware.json": "hardware", "data/dataset.npz": "download"},
    "speed": {"data/hardware.json": "hardware", "data/dataset.npz": "download", "reports/sweep/planner.json": "sweep"},
    "train": {
        "data/hardware.json": "hardware",
        "data/dataset.npz": "download",
        "data/provenance.json": "download",
        "reports/sweep/planner.json": "sweep",
    },
    "report": {
        "data/hardware.json": "hardware",
        "data/provenance.json": "download",
        "reports/variants/baseline/metrics.json": "train",
        "reports/sweep/planner.json": "sweep",
        "reports/trace.json": "trace",
        "reports/speed.json": "speed",
        "reports/gradcheck.json": "gradcheck",
    },
}
OPTIONAL = {"reports/sweep/planner.json", "reports/trace.json", "reports/speed.json", "reports/gradcheck.json"}
CASES = [
    (stage, path, maker, how)
    for stage, inputs in INPUTS.items()
    for path, maker in inputs.items()
    for how in (("damaged",) if path in OPTIONAL else ("missing", "damaged"))  # optional: absent is fine
    + (("another format",) if path.endswith(".json") else ())  # a record the code does not read: never guessed at
]


def inputs_in_place(workdir: Path) -> None:
    """Every input, as the stages before would have left it (the report's variant record included)."""
    values = params.read(workdir / "params.yaml")
    (workdir / "params.yaml").write_text(yaml.safe_dump(params.assign(values, TINY), sort_keys=False))
    write_json(workdir / "data/hardware.json", HARDWARE)
    write_json(workdir / "data/provenance.json", {"format": 1, "kind": "local", "dataset": "mnist"})
    images, labels = np.zeros((100, 28, 28), np.uint8), np.arange(100, dtype=np.uint8) % 10
    mnist.save({"train_x": images, "train_y": labels, "test_x": images, "test_y": labels}, workdir / "data/dataset.npz")
    line, budget = {"fixed_mib": 100.0, "per_sample_mib": 1.0}, {"what": "RAM", "memory_mib": 9e9, "safety_margin": 0}
    plan = {"format": 2, "device": "cpu", "scale": "cpu", "batch": 32, "measure": "peak RSS", "points": []}
    plan |= {"line": line, "line_checkpointing": line, "auto_accum": 1, "auto_accum_checkpointing": 1}
    write_json(workdir / "reports/sweep/planner.json", plan | {"this_machine": budget})
    for name in ("reports/trace.json", "reports/speed.json", "reports/gradcheck.json"):
        write_json(workdir / name, {"format": 1})
    folder = workdir / "reports/variants/baseline"
    folder.mkdir(parents=True)
    record = VariantRecord(
        format=1, cudnn=CudnnRun(),
        variant="baseline", norm="batch", weighting="exact", epoch_end_step=True, swap="keep_act", accum=1,
        accum_setting=1, micro_batch=32, batch=32, lr=1e-3, scale="cpu", device="cpu", amp="float32",
        train_samples=64, test_samples=32, parameters=1, completed=True, optimizer_steps=2, skipped_steps=0,
        train_seconds=1.0,
        memory=MemoryPeaks(samples=1, interval_ms=200, rss_peak_mib=1.0),
    )  # fmt: skip
    write_json(folder / "metrics.json", record.model_dump(mode="json"))
    (folder / "epochs.tsv").write_text("\t".join(EPOCH_COLUMNS) + "\n")
    (folder / "memory.csv").write_text(",".join(TIMELINE_COLUMNS) + "\n")
    (folder / "steps.tsv").write_text("\t".join(STEP_COLUMNS) + "\n")


@pytest.mark.parametrize(("stage", "path", "maker", "how"), CASES, ids=lambda v: str(v))
def test_a_missing_or_damaged_input_is_one_line_naming_the_stage_that_makes_it(
    workdir: Path,
    stage: str,
    path: str,
    maker: str,
    how: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    inputs_in_place(workdir)
    target = workdir / path
    if how == "missing":
        target.unlink()
    elif how == "another format":
        write_json(target, json.loads(target.read_text()) | {"format": 0})
    else:
        target.write_bytes(b"\x00not what the stage wrote")
    monkeypatch.setattr(sys, "argv", [f"stages/{stage}.py", *(["accumulation"] if stage == "train" else [])])
    monkeypatch.delitem(sys.modules, f"stages.{stage}", raising=False)
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module(f"stages.{stage}", run_name="__main__", alter_sys=True)
    out, err = capfd.readouterr()
    assert stopped.value.code == REFUSED, out + err
    [line] = err.strip().splitlines()
    # A variant's record: its folder when damaged; with none left, the folder of all of them.
    named = (str(Path(path).parent) if how != "missing" else "reports/variants/") if "variants" in path else path
    assert line.startswith("error: ") and named in line, line
    assert f"`dvc repro {maker}" in line or f"`dvc repro -f {maker}" in line, line
    assert "Traceback" not in out + err


def test_the_cases_cover_every_stage_that_reads_another_stages_output() -> None:
    dvc = yaml.safe_load((Path(__file__).resolve().parent.parent / "dvc.yaml").read_text())["stages"]
    produced = {}
    for name, spec in dvc.items():
        spec = spec.get("do", spec)
        for out in [o for key in ("outs", "metrics", "plots") for o in spec.get(key, [])]:
            produced[next(iter(out)) if isinstance(out, dict) else out] = name
    for stage, inputs in INPUTS.items():
        spec = dvc[stage].get("do", dvc[stage])
        read = {d for d in spec["deps"] if d in produced or d.startswith("reports/variants")}
        assert {p for p in inputs if not p.startswith("reports/variants")} >= read - {"reports/variants"}, stage
    assert json.dumps(CASES)  # every case is plain data: its id names it
