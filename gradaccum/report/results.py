"""Each variant's outputs as the report reads them, and the few figures every table takes from one."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from gradaccum.outputs import MissingInput
from gradaccum.records import MemoryPeaks, VariantRecord, invalid


@dataclass
class VariantResult:
    """One variant's outputs: its record, its rows per epoch, its memory timeline, its rows per step."""

    record: VariantRecord
    epochs: pd.DataFrame
    timeline: pd.DataFrame
    steps: pd.DataFrame | None = None  # a row per optimizer step (steps.tsv)


Results = dict[str, VariantResult]


def load_variants(names: list[str], folder: Path) -> Results:
    """Each variant's record, epochs and memory timeline from `folder/<variant>/`; variants not run are left out."""
    results = {}
    for name in names:
        d = folder / name
        if not (d / "metrics.json").exists():
            continue
        try:
            results[name] = VariantResult(
                record=VariantRecord.read(d / "metrics.json"),
                epochs=pd.read_csv(d / "epochs.tsv", sep="\t"),
                timeline=pd.read_csv(d / "memory.csv"),
                steps=pd.read_csv(d / "steps.tsv", sep="\t"),
            )
        except (OSError, ValueError) as err:  # a missing curve, a damaged record (pydantic's error is a ValueError)
            first = invalid(err) if isinstance(err, ValidationError) else str(err).splitlines()[0]
            raise MissingInput(
                f"{d}/ cannot be read ({type(err).__name__}: {first}): `dvc repro -f train@{name}` makes it again"
            ) from None
    if not results:
        raise MissingInput(f"no variant has a metrics.json under {folder}/: `dvc repro train` makes them")
    return results


def peak_mib(m: VariantRecord, memory: MemoryPeaks | None = None) -> float | None:
    """The headline memory figure: what nvidia-smi saw on a GPU, the RSS high-water mark on the CPU.

    `memory`: one process's peaks instead of the record's (the largest process's).
    """
    if m.did_not_fit:
        return m.did_not_fit.memory_at_failure_mib
    if m.not_run:
        return None
    mem = memory or m.memory
    if m.device == "cuda":
        return mem.nvidia_smi_peak_mib or mem.torch_max_reserved_mib
    return mem.rss_peak_mib


def memory_label(device: str) -> str:
    return "peak GPU memory, nvidia-smi (MiB)" if device == "cuda" else "peak host memory, RSS (MiB)"


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def seed_values(m: VariantRecord, key: str) -> list[float]:
    """A variant's end points (final_train_loss or test_accuracy) over its seeds; the record's own without them."""
    values = [getattr(r, key) for r in m.seeds]
    return values or ([getattr(m, key)] if getattr(m, key) is not None else [])


def seed_mean(m: VariantRecord, key: str) -> float | None:
    values = seed_values(m, key)
    return statistics.fmean(values) if values else None


def seed_text(m: VariantRecord, key: str) -> str:
    """The mean over seeds and its range; the single value with one seed."""
    values = seed_values(m, key)
    if len(values) < 2:
        return fmt(values[0] if values else None)
    return f"{statistics.fmean(values):.4f} ({min(values):.4f} to {max(values):.4f})"


def relative(change: float) -> str:
    """A relative change: in percent, or in powers of ten where it is too small for a percent to show."""
    return f"{change:+.1%}" if abs(change) >= 1e-3 else f"{change:+.1e}"


def peak_split(m: VariantRecord) -> dict[str, float]:
    """The peak in parts: PyTorch's allocations, its cache, and what else nvidia-smi saw (or host RSS)."""
    if m.did_not_fit:
        return {"did not fit (memory at failure)": float(m.did_not_fit.memory_at_failure_mib or 0)}
    if m.not_run:
        return {}
    mem = m.memory
    if m.device != "cuda":
        return {"host RSS": mem.rss_peak_mib}
    allocated, reserved = mem.torch_max_allocated_mib, mem.torch_max_reserved_mib
    smi = mem.nvidia_smi_peak_mib or reserved
    return {
        "allocated by PyTorch": allocated,
        "cached by PyTorch": reserved - allocated,
        "CUDA context and the rest": max(smi - reserved, 0.0),
    }
