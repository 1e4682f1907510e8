"""`make repro` on a fresh clone, timed stage by stage: where its minutes go.

    python -m benchmarks.repro [--out benchmarks/results/repro-NAME.json] [--keep DIR] [-S seeds=3 ...]

Clones this checkout's committed HEAD into a temp folder and runs `make repro` there with this
checkout's virtual environment linked in (a fresh clone once `make test` has made the environment:
make then runs `dvc repro` alone). Each stage's wall time is read from DVC's own output as it streams, so DVC's
bookkeeping between stages counts; the stages' records split the study's computation (the sweep's
points, the gradient check, the training loops) from the pipeline's own overhead: process start-up,
imports, evaluation, sampling, writing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradaccum.outputs import read_json, write_json
from gradaccum.records import Plan, VariantRecord
from gradaccum.report.variants import stage_times

GOAL_SECONDS, OVERHEAD_GOAL = 360, 0.15  # the speed issue's goals: six minutes, overhead under 15%


def timed_repro(clone: Path) -> tuple[dict[str, float], float]:
    """Run `make repro` in `clone`; each stage's seconds from its 'Running stage' line to the next, and the total."""
    (clone / ".venv").symlink_to(Path(sys.prefix))  # made by `make test`: make skips the install
    start = time.monotonic()
    make = ["make", "--old-file", ".venv/bin/.installed", "repro"]  # the clone's lock file is newer than the venv
    proc = subprocess.Popen(make, cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: list[tuple[str, float]] = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        if found := re.match(r"Running stage '([^']+)'", line):
            marks.append((found[1], time.monotonic()))
    if proc.wait() != 0:
        sys.exit(f"make repro failed with exit code {proc.returncode}")
    end = time.monotonic()
    ends = [t for _, t in marks[1:]] + [end]
    return {name: stop - t for (name, t), stop in zip(marks, ends, strict=True)}, end - start


def breakdown(clone: Path, walls: dict[str, float], total: float) -> dict[str, Any]:
    """Per stage: DVC's wall time, the process's own, the computation; and the overhead against the goal."""
    reports = clone / "reports"
    records = {p.parent.name: VariantRecord.read(p) for p in sorted(reports.glob("variants/*/metrics.json"))}
    timed = stage_times(
        records,
        Plan.model_validate_json((reports / "sweep/planner.json").read_text()),
        read_json(reports / "gradcheck.json"),
        read_json(reports / "speed.json"),
        read_json(reports / "trace.json"),
    )
    stages = {
        name: {
            "wall_s": round(wall, 1),
            "process_s": timed.get(name, (None,))[0],
            "computation_s": timed.get(name, (0, 0))[1],
        }
        for name, wall in walls.items()
    }
    work = sum(s["computation_s"] for s in stages.values())
    return {
        "total_s": round(total, 1),
        "goal_s": GOAL_SECONDS,
        "computation_s": round(work, 1),
        "overhead_s": round(total - work, 1),
        "overhead_share": round((total - work) / total, 3),
        "overhead_goal": OVERHEAD_GOAL,
        "by_stage": stages,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'stage':32} {'wall s':>7} {'process s':>10} {'computation s':>14}"]
    for name, s in result["by_stage"].items():
        process = f"{s['process_s']:.1f}" if s["process_s"] is not None else "-"
        lines.append(f"{name:32} {s['wall_s']:7.1f} {process:>10} {s['computation_s']:14.1f}")
    lines.append(
        f"make repro on a fresh clone: {result['total_s']:.0f} s (goal {result['goal_s']} s); computation "
        f"{result['computation_s']:.0f} s; overhead {result['overhead_s']:.0f} s = {result['overhead_share']:.0%} "
        f"(goal under {result['overhead_goal']:.0%})"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/repro-latest.json"))
    parser.add_argument(
        "--keep", type=Path, help="copy the run's reports/ here (a reference run, made from a clean clone)"
    )
    parser.add_argument(
        "-S",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a param in the clone's params.yaml first (python -m gradaccum.params), as dvc exp run -S does",
    )
    args = parser.parse_args()
    if args.keep and args.keep.exists():
        parser.error(f"--keep {args.keep}: already exists; pick a new folder")
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", ".", str(clone)], check=True)
        for setting in args.overrides:  # checked and written with params.yaml's comments kept
            subprocess.run(
                [sys.executable, "-m", "gradaccum.params", "params.yaml", "-S", setting], cwd=clone, check=True
            )
        walls, total = timed_repro(clone)
        result = breakdown(clone, walls, total)
        if args.keep:
            keep_out = shutil.ignore_patterns("reference", ".gitignore")  # not this run's; DVC's would hide it
            shutil.copytree(clone / "reports", args.keep, ignore=keep_out)
            for name in ("data/hardware.json", "data/provenance.json", "params.yaml"):  # to re-render its report
                shutil.copy(clone / name, args.keep)
    result |= {
        "overrides": args.overrides,
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip(),
    }
    print(table(result))
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
