"""Where each stage reads and writes: one definition, so stages share files without importing each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gradaccum.outputs import MissingInput, read_input, read_json, write_json
from gradaccum.records import FORMAT, Hardware, Plan, invalid

T = TypeVar("T", bound=BaseModel)

HARDWARE = Path("data/hardware.json")
RAW_DIR = Path("data/raw")  # verified downloads, kept (git-ignored) so a re-run needs no network
DATASET = Path("data/dataset.npz")
PROVENANCE = Path("data/provenance.json")
SWEEP_PLAN = Path("reports/sweep/planner.json")
SWEEP_POINTS = Path("reports/sweep/points.tsv")
GRADCHECK = Path("reports/gradcheck.json")
GRADCHECK_TSV = Path("reports/gradcheck.tsv")
SPEED = Path("reports/speed.json")
VALIDATION = Path("docs/validation.json")  # python -m benchmarks.validate --write docs/validation.json, committed
TRACE = Path("reports/trace.json")
VARIANTS = Path("reports/variants")


def variant_dir(variant: str) -> Path:
    return VARIANTS / variant


def live_dir(variant: str) -> Path:
    """DVCLive's files of a variant's run, updated each epoch (gradaccum/live.py)."""
    return VARIANTS / variant / "live"


def weights_path(variant: str) -> Path:
    return Path("data/models") / f"{variant}.pt"


# The stage that makes each file another stage reads: what a missing input's one line tells the user to run.
MADE_BY = {
    HARDWARE: "hardware",
    PROVENANCE: "download",
    SWEEP_PLAN: "sweep",
    GRADCHECK: "gradcheck",
    SPEED: "speed",
    TRACE: "trace",
}


def write_record(path: Path, record: dict[str, Any]) -> None:
    """A record another stage reads (provenance, gradient check, speed, trace), with the format it is read in."""
    write_json(path, {"format": FORMAT} | record)


def read(path: Path) -> Any:
    """A record `write_record` wrote, or one line naming it and `dvc repro <the stage that makes it>`: where it is
    missing, and where it is of another format than this code reads."""
    record = read_input(path, MADE_BY[path])
    if record.get("format") != FORMAT:
        again = f"`dvc repro -f {MADE_BY[path]}` makes it again"
        raise MissingInput(f"{path}: format {record.get('format')!r}, not this code's {FORMAT}: {again}")
    return record


def read_validation() -> Any:
    """The validation's rows and summary where they are; not a stage's output, so its own command remakes it."""
    if not VALIDATION.exists():
        return None
    try:
        return read_json(VALIDATION)
    except ValueError as err:
        again = f"`python -m benchmarks.validate --write {VALIDATION}` makes it again"
        raise MissingInput(f"{VALIDATION} cannot be read ({type(err).__name__}: {err}): {again}") from None


def read_if_there(path: Path) -> Any:
    """An input a stage can do without (the planner's result unless accum is auto; the report's optional parts)."""
    return read(path) if path.exists() else None


def hardware() -> Hardware:
    """data/hardware.json, typed: the device and scale this checkout trains on."""
    return typed(HARDWARE, Hardware)


def sweep_plan() -> Plan | None:
    """reports/sweep/planner.json, typed, where the sweep has run (train needs it only for accum: auto)."""
    return typed(SWEEP_PLAN, Plan) if SWEEP_PLAN.exists() else None


def typed(path: Path, model: type[T]) -> T:
    """A stage's JSON input read into its type; one written by other code says so in one line."""
    try:
        return model.model_validate(read_input(path, MADE_BY[path]))
    except ValidationError as err:
        again = f"`dvc repro -f {MADE_BY[path]}` makes it again"
        raise MissingInput(f"{path}: {invalid(err)}, not what this code reads: {again}") from None
