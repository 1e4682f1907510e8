"""`dvc plots show`: the four charts people compare, each series its own, axes titled with units.

The spec DVC renders is checked, not dvc.yaml's text: a fake workspace holding every variant's curves and the
sweep's points, `dvc plots show --json` over it, and each chart's series and titles read from what it returns.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gradaccum import params
from gradaccum.loop import EPOCH_COLUMNS, STEP_COLUMNS
from gradaccum.memory import TIMELINE_COLUMNS
from gradaccum.sweep import POINT_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
PLOTS = ("train_loss", "test_accuracy", "memory", "sweep")
DVC = str(Path(sys.executable).parent / "dvc")


def top_level_plots() -> dict[str, dict]:
    entries = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    return {name: spec for entry in entries for name, spec in entry.items()}


def test_each_chart_lists_every_variant_and_no_stage_declares_its_own_plots() -> None:
    dvc_yaml = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    variants = list(params.load(ROOT / "params.yaml", model_names=False).variants)
    plots = top_level_plots()
    assert list(plots) == list(PLOTS)
    for name in ("train_loss", "test_accuracy", "memory"):
        listed = [Path(file).parent.name for file in plots[name]["y"]]
        assert listed == variants, name  # a variant added to params.yaml and not here would vanish from the chart
    assert all("plots" not in stage for stage in dvc_yaml["stages"].values())  # no per-file duplicate charts


def write_rows(path: Path, columns: tuple[str, ...], rows: list[dict], delimiter: str = "\t") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, delimiter=delimiter)
        writer.writeheader()
        writer.writerows({c: row.get(c, "") for c in columns} for row in rows)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """`dvc plots show --json` over a fake CPU workspace: every variant's curves, the sweep's two ladders."""
    repo = tmp_path_factory.mktemp("plots")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, repo / name)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([DVC, "init", "--no-scm", "-q"], cwd=repo, check=True, env=env)
    shutil.copytree(ROOT / ".dvc/plots", repo / ".dvc/plots", dirs_exist_ok=True)
    for i, variant in enumerate(params.load(ROOT / "params.yaml", model_names=False).variants):
        out = repo / "reports/variants" / variant
        write_rows(out / "steps.tsv", STEP_COLUMNS, [{"step": s, "epoch": 1, "train_loss": 5 - s / 10} for s in (1, 2)])
        write_rows(out / "epochs.tsv", EPOCH_COLUMNS, [{"epoch": e, "test_accuracy": e / 10} for e in (1, 2)])
        memory = [{"seconds": t, "memory_mib": 900 + i + t, "rss_mib": 900 + i + t, "source": "rss"} for t in (0, 1)]
        write_rows(out / "memory.csv", TIMELINE_COLUMNS, memory, delimiter=",")  # process_mib empty, as on a CPU
    points = [
        {"micro_batch": m, "checkpointing": ckpt, "fit": True, "peak_mib": 800 + m * (1.3 if ckpt else 2.0)}
        for ckpt in (False, True)
        for m in (64, 256, 512)
    ]
    write_rows(repo / "reports/sweep/points.tsv", POINT_COLUMNS, points)
    shown = subprocess.run([DVC, "plots", "show", "--json"], cwd=repo, check=True, env=env, capture_output=True)
    result = json.loads(shown.stdout)
    assert not result.get("errors"), result["errors"]
    return {name: plots[0]["content"] for name, plots in result["data"].items()}


def test_four_charts_and_no_per_file_duplicates(rendered: dict[str, dict]) -> None:
    assert list(rendered) == list(PLOTS)


@pytest.mark.parametrize("name", PLOTS)
def test_every_axis_says_what_it_measures(rendered: dict[str, dict], name: str) -> None:
    spec, declared = rendered[name], top_level_plots()[name]
    assert spec["encoding"]["x"]["title"] == declared["x_label"]
    assert spec["encoding"]["y"]["title"] == declared["y_label"] and spec["encoding"]["y"]["title"] != "y"
    assert spec["title"] == declared["title"]
    if name in ("memory", "sweep"):
        assert "(MiB)" in declared["y_label"]


@pytest.mark.parametrize("name", ["train_loss", "test_accuracy", "memory"])
def test_one_colour_per_variant_one_dash_per_revision(rendered: dict[str, dict], name: str) -> None:
    spec = rendered[name]
    assert {"calculate": "split(datum.filename, '/')[0]", "as": "variant"} in spec["transform"]
    assert spec["encoding"]["color"]["field"] == "variant" and spec["encoding"]["strokeDash"]["field"] == "rev"
    series = {row["filename"].split("/")[0] for row in spec["data"]["values"]}
    assert series == set(params.load(ROOT / "params.yaml", model_names=False).variants)
    assert "mark" in spec and "loess" not in json.dumps(spec)  # drawn as measured, never smoothed
    if name == "memory":  # one column, the device's own figure: no empty GPU column drawn at zero
        assert {row["memory_mib"] for row in spec["data"]["values"]} >= {"900", "901"}
        assert all("process_mib" not in str(row.get("filename::field", "")) for row in spec["data"]["values"])


def test_the_sweep_is_two_series_one_per_lever(rendered: dict[str, dict]) -> None:
    spec = rendered["sweep"]
    assert spec["encoding"]["color"]["field"] == "series" and spec["mark"]["point"] is True
    calculated = next(t for t in spec["transform"] if t.get("as") == "series")["calculate"]
    assert "datum.checkpointing == 'True'" in calculated  # plain and checkpointing points are never joined
    assert {row["checkpointing"] for row in spec["data"]["values"]} == {"False", "True"}
    assert "loess" not in json.dumps(spec)
