"""Where each stage reads and writes: one definition, so stages share files without importing each other."""

from __future__ import annotations

from pathlib import Path

HARDWARE = Path("data/hardware.json")
RAW_DIR = Path("data/raw")  # verified downloads, kept (git-ignored) so a re-run needs no network
DATASET = Path("data/dataset.npz")
PROVENANCE = Path("data/provenance.json")
SWEEP_PLAN = Path("reports/sweep/planner.json")
SWEEP_POINTS = Path("reports/sweep/points.tsv")
GRADCHECK = Path("reports/gradcheck.json")
GRADCHECK_TSV = Path("reports/gradcheck.tsv")
SPEED = Path("reports/speed.json")
TRACE = Path("reports/trace.json")
VARIANTS = Path("reports/variants")


def variant_dir(variant: str) -> Path:
    return VARIANTS / variant


def live_dir(variant: str) -> Path:
    """DVCLive's files of a variant's run, updated each epoch (gradaccum/live.py)."""
    return VARIANTS / variant / "live"


def weights_path(variant: str) -> Path:
    return Path("data/models") / f"{variant}.pt"
