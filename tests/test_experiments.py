"""docs/experiments.md, held to dvc.yaml: the table of what a change re-runs, and the `dvc exp show` line."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs/experiments.md").read_text()
STAGES = ("hardware", "download", "sweep", "gradcheck", "speed", "trace", "train")


def own_params(dvc: dict, params: dict) -> dict[str, list[str]]:
    """Each stage's params entries, the train foreach expanded for every variant (its key and its `extra`)."""
    out = {}
    for name, stage in dvc["stages"].items():
        if "foreach" not in stage:
            out[name] = [e for e in stage.get("params", []) if isinstance(e, str)]
            continue
        for key, item in params["variants"].items():
            entries = [e.replace("${key}", key).replace("${item.extra}", item["extra"]) for e in stage["do"]["params"]]
            out[f"{name}@{key}"] = entries
    return out


def rerun_by(key: str, entries: dict[str, list[str]]) -> set[str]:
    """The stages (train@ variants grouped) whose own params cover `key`, or a key under it."""
    def covers(entry: str) -> bool:
        return key == entry or key.startswith(entry + ".") or entry.startswith(key + ".")

    hit = {s for s, es in entries.items() if any(covers(e) for e in es)}
    trains = {s for s in hit if s.startswith("train@")}
    every = {s for s in entries if s.startswith("train@")}
    return (hit - trains) | ({"train"} if trains == every else {"train@some"} if trains else set())


def documented() -> dict[str, set[str]]:
    table = DOC.split("| key changed |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        keys_cell, stages_cell = line.strip("|").split("|")[:2]
        every, _, some = re.sub(r"`[^`]*`", "", stages_cell).partition(";")  # "; trace for `train.amp_cuda` ..."
        named = {s for s in STAGES if re.search(rf"\b{s}\b", every)}
        extra = {s for s in STAGES if re.search(rf"\b{s}\b", some)}
        if "train stage" in stages_cell:  # one variant's, or those that follow accum
            named = (named - {"train"}) | {"train@some"}
        for key in re.findall(r"`([a-z_.A-Z]+)`", keys_cell):
            rows[key] = named | {f"{s} (sub-keys)" for s in extra}
    return rows


def test_the_table_of_what_a_change_reruns_is_dvc_yamls() -> None:
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    entries = own_params(dvc, params)
    rows = documented()
    top_level = set(params) - {"variants"}
    assert top_level <= {k.split(".")[0] for k in rows}, "a top-level key is missing from docs/experiments.md"
    for key, stages in rows.items():
        probe = "variants.baseline" if key == "variants.NAME" else key
        expected = rerun_by(probe, entries) - {"report"}
        whole = {s for s in stages if not s.endswith("(sub-keys)")}
        partial = {s.removesuffix(" (sub-keys)") for s in stages if s.endswith("(sub-keys)")}
        assert whole | partial == expected, (key, stages, expected)
    assert all("params.yaml" in str(e) for e in dvc["stages"]["report"]["params"])  # every change re-runs it


def test_the_exp_show_line_keeps_seeds_and_is_the_readmes() -> None:
    """Its width is measured on real experiments by tests/test_pipeline.py (slow)."""
    line = next(line for line in DOC.splitlines() if line.startswith("dvc exp show --no-pager"))
    keep = re.search(r"--keep '([^']+)'", line)[1]
    columns = ("Experiment", "accum", "seeds", "seed", "memory_ratio", "accumulation.peak_mib", "baseline.loss")
    kept = [c for c in columns if re.search(keep, c)]
    assert kept == ["Experiment", "accum", "seeds", "memory_ratio", "accumulation.peak_mib", "baseline.loss"]
    assert line in (ROOT / "README.md").read_text()  # one command, in both places


def numbers(value: object) -> int:
    if isinstance(value, dict):
        return sum(numbers(v) for v in value.values())
    return int(isinstance(value, int | float) and not isinstance(value, bool))


def test_dvc_exp_show_compares_the_reports_few_numbers_only() -> None:
    """Every metrics file a stage declares is a column group of `dvc exp show`: only the report's summary is one,
    and it holds at most 40 numbers (DVCLive's live values per variant would add about seven each)."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    declared = []
    for stage in dvc["stages"].values():
        for entry in stage.get("do", stage).get("metrics", []):
            declared.append(next(iter(entry)) if isinstance(entry, dict) else entry)
    assert declared == ["reports/metrics.json"]
    summary = yaml.safe_load((ROOT / "reports/metrics.json").read_text())
    assert 20 <= numbers(summary) <= 40
