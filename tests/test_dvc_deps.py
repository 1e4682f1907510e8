"""dvc.yaml's deps cover every project file each stage runs, and the layout keeps the library apart from stages.

The imports of each stage command are followed through the repository (ast, no import executed), so a
module a stage starts to use, or one it stops using, shows up here before DVC serves a stale result.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gradaccum", "stages")


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """The project's modules a file imports, and the ones it runs with `python -m` (the sweep's points)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+", node.value):
            found.add(node.value)  # "-m", "gradaccum.sweep": a module run as a child process
    return {m for m in found if m.split(".")[0] in PACKAGES and module_file(m)}


def files_run(module: str) -> set[Path]:
    """Every project file `python -m module` executes: its imports, transitively, and their packages' __init__."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b runs a/__init__.py first
        path = module_file(name)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += imported_modules(path)
    return {p for p in seen if p.read_text().strip()}  # an empty __init__.py runs nothing


def stage_commands(dvc: dict) -> dict[str, tuple[str, list[str]]]:
    """stage -> (the module its cmd runs, its deps)."""
    out = {}
    for name, stage in dvc["stages"].items():
        body = stage.get("do", stage)
        match = re.search(r"python\S*\s+-m\s+([\w.]+)", body["cmd"])
        assert match, f"stage {name}: cmd {body['cmd']!r} is not `python -m MODULE`"
        out[name] = (match.group(1), body.get("deps", []))
    return out


def dep_problems(dvc: dict) -> list[str]:
    problems = []
    for stage, (module, deps) in stage_commands(dvc).items():
        run = {p.relative_to(ROOT).as_posix() for p in files_run(module)}
        missing = sorted(f for f in run if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps))
        extra = sorted(d for d in deps if d.endswith(".py") and d not in run)
        problems += [f"{stage}: runs {f} but does not list it in deps" for f in missing]
        problems += [f"{stage}: lists {f} in deps but does not run it" for f in extra]
    return problems


@pytest.fixture(scope="module")
def dvc() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_every_stage_lists_exactly_the_files_it_runs(dvc: dict) -> None:
    assert dep_problems(dvc) == []


def test_a_removed_dep_is_caught(dvc: dict) -> None:
    """The check above can fail: drop the distributed module from train's deps and it must say so."""
    dvc["stages"]["train"]["do"]["deps"].remove("gradaccum/distributed.py")
    assert dep_problems(dvc) == ["train: runs gradaccum/distributed.py but does not list it in deps"]


def test_the_sweeps_child_process_counts_as_run() -> None:
    assert ROOT / "gradaccum/sweep.py" in files_run("stages.sweep")
    assert ROOT / "gradaccum/report/document.py" not in files_run("stages.train")


def stages_covering(dvc: dict, key: str) -> set[str]:
    """The stages whose params include `key` (by itself, a section above it, or the whole params.yaml)."""
    covering = set()
    for name, stage in dvc["stages"].items():
        for entry in stage.get("do", stage).get("params", []):
            whole_file = isinstance(entry, dict) and "params.yaml" in entry and not entry["params.yaml"]
            if whole_file or (isinstance(entry, str) and (key == entry or key.startswith(entry + "."))):
                covering.add(name)
    return covering


def test_card_sizes_rerun_the_trace_and_the_report_only(dvc: dict) -> None:
    """The GPU card table replays the traced step on each card (trace); the report words it and the sweep's."""
    assert stages_covering(dvc, "memory.cards_gb") == {"trace", "report"}


def test_settings_that_change_training_rerun_it(dvc: dict) -> None:
    for key in ("memory.interval_ms", "memory.host_budget_gb", "train.amp_cpu", "model.name", "seed"):
        assert "train" in stages_covering(dvc, key), key
    assert {"sweep", "trace", "report"} <= stages_covering(dvc, "memory.safety_margin")  # accum: auto, card tables


def test_no_library_module_imports_a_stage_and_no_stage_imports_another() -> None:
    for path in sorted((ROOT / "gradaccum").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        stages = {m for m in imported_modules(path) if m.split(".")[0] == "stages"}
        assert not stages, f"{path.relative_to(ROOT)} imports {stages}: library code must not know the pipeline"
    for path in sorted((ROOT / "stages").glob("*.py")):
        own = f"stages.{path.stem}"  # the train stage re-runs itself under torchrun
        others = {m for m in imported_modules(path) if m.startswith("stages.") and m not in ("stages.paths", own)}
        assert not others, f"{path.relative_to(ROOT)} imports {others}: a stage never imports another stage"


def test_the_committed_dvc_lock_is_in_step_with_the_code_and_params() -> None:
    """dvc.lock is committed, as DVC means it to be: the record of which code and params made the committed
    reports/metrics.json. A change to a stage's code, command or params without the run that follows it (make
    repro, then commit dvc.lock and reports/metrics.json) would have a clone's `dvc status` name stale provenance.
    Outputs are not compared: a clone has none (no DVC remote), and `dvc repro` makes them."""
    import json
    import subprocess
    import sys

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    tracked = set(run("git", "ls-files").split())
    status = json.loads(run(str(Path(sys.executable).with_name("dvc")), "status", "--json"))
    stale = {}
    for stage, changes in status.items():
        for change in changes:
            if change == "changed command":
                stale.setdefault(stage, []).append("its command")
            elif isinstance(change, dict) and "changed deps" in change:
                for path, what in change["changed deps"].items():
                    if path == "params.yaml" or path in tracked:  # code and params; not another stage's output
                        stale.setdefault(stage, []).append(f"{path}: {what}")
    assert stale == {}, f"dvc.lock is behind the code: run `make repro`, then commit dvc.lock: {stale}"


def test_a_fresh_clones_dvc_status_lists_missing_outputs_only(tmp_path: Path) -> None:
    """What the README says a clone's `dvc status` shows: outputs and the deps they make, deleted or not in the
    cache, and nothing modified (reports/variants held DVC's committed .gitignore files, reported as modified)."""
    import json
    import shutil
    import subprocess
    import sys

    clone = tmp_path / "clone"  # the working tree's tracked files, as a clone of it would hold them
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, tracked.split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    dvc_bin = str(Path(sys.executable).with_name("dvc"))
    out = subprocess.run([dvc_bin, "status", "--json"], cwd=clone, capture_output=True, text=True, check=True)
    modified = [
        (stage, path)
        for stage, changes in json.loads(out.stdout).items()
        for change in changes
        if isinstance(change, dict)
        for kind in ("changed deps", "changed outs")
        for path, what in change.get(kind, {}).items()
        if what == "modified"
    ]
    assert modified == []
