"""Memory over time: nvidia-smi snapshots on a GPU, resident set size (RSS) on the CPU.

A background thread samples every `interval_ms`; each nvidia-smi call is a short child process
that is always waited for, so stopping (on success, error or Ctrl-C) leaves no orphan behind.
"""

from __future__ import annotations

import csv
import io
import os
import resource
import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil

MIB = 2**20
GPU_FIELDS = ("index", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "used_memory")  # nvidia-smi heads this column "used_gpu_memory [MiB]"
MISSING = {"[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", "[Insufficient Permissions]", ""}
TIMELINE_COLUMNS = ("seconds", "process_mib", "gpu_used_mib", "gpu_total_mib", "gpu_util_pct", "rss_mib", "source")


def query(fields: tuple[str, ...], kind: str = "gpu") -> list[str]:
    return [f"--query-{kind}={','.join(fields)}", "--format=csv,nounits"]


def parse_csv(text: str, fields: tuple[str, ...]) -> list[dict[str, float | None]]:
    """Rows of `nvidia-smi --query-... --format=csv[,nounits][,noheader]`, keyed by the fields asked for.

    Keyed by position, because nvidia-smi's header names differ from the query names. Units
    ("7242 MiB", "97 %") are dropped; `[N/A]` and `[Not Supported]` become None; a header and
    no rows (no process on the GPU) gives [].
    """
    rows = []
    for fields_text in csv.reader(io.StringIO(text), skipinitialspace=True):
        values = [v.strip() for v in fields_text]
        if not any(values):
            continue
        if not rows and not _is_value(values[0]):
            continue  # the header line
        if len(values) != len(fields):
            raise ValueError(f"nvidia-smi row {values} does not have the {len(fields)} fields {fields}")
        rows.append({f: None if v in MISSING else float(v.split()[0]) for f, v in zip(fields, values, strict=True)})
    return rows


def _is_value(text: str) -> bool:
    try:
        float(text.split()[0])
    except (ValueError, IndexError):
        return text in MISSING
    return True


def run_nvidia_smi(args: list[str], timeout: float = 10.0) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def peak_rss_mib() -> float:
    """The kernel's high-water mark of this process's resident memory (VmHWM).

    Not getrusage's ru_maxrss: Linux carries that over fork and exec, so a process started by a
    big parent (DVC, a benchmark) would report the parent's peak as its own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, the fallback elsewhere


class MemorySampler:
    """Samples memory in a thread while a `with` block runs; rows and peaks are read after it ends.

    device "cuda": this process's memory from nvidia-smi's process list, or the GPU-wide
    figure when the list does not show our PID (a container's PID namespace); "cpu": RSS.
    """

    def __init__(self, device: str, interval_ms: int, gpu_index: int = 0) -> None:
        self.device, self.interval, self.gpu_index = device, interval_ms / 1000, gpu_index
        self.rows: list[dict[str, Any]] = []
        self.peak_snapshot: str | None = None  # plain `nvidia-smi` text at the highest reading
        self.errors: list[str] = []
        self.nvidia_smi = device == "cuda" and shutil.which("nvidia-smi") is not None
        if device == "cuda" and not self.nvidia_smi:
            warnings.warn("nvidia-smi not on PATH: no GPU snapshots; PyTorch's figures still recorded", stacklevel=2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = psutil.Process(os.getpid())
        self._start = 0.0
        self._peak = -1.0

    def __enter__(self) -> MemorySampler:
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            try:
                self.rows.append(self.sample())
            except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
                if len(self.errors) < 20:
                    self.errors.append(f"{time.perf_counter() - self._start:.2f}s: {err}")
            if self._stop.wait(self.interval):
                break

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(TIMELINE_COLUMNS)
        row["seconds"] = round(time.perf_counter() - self._start, 3)
        row["rss_mib"] = round(self._process.memory_info().rss / MIB, 1)
        if not self.nvidia_smi:
            row["source"] = "rss"
            return row
        gpus = [g for g in parse_csv(run_nvidia_smi(query(GPU_FIELDS)), GPU_FIELDS) if g["index"] == self.gpu_index]
        gpu = gpus[0] if gpus else {}
        row.update(
            gpu_used_mib=gpu.get("memory.used"),
            gpu_total_mib=gpu.get("memory.total"),
            gpu_util_pct=gpu.get("utilization.gpu"),
        )
        apps = parse_csv(run_nvidia_smi(query(APP_FIELDS, "compute-apps")), APP_FIELDS)
        mine = [a for a in apps if a["pid"] == os.getpid()]
        if mine and mine[0].get("used_memory") is not None:
            row["process_mib"], row["source"] = mine[0]["used_memory"], "process"
        else:
            row["process_mib"], row["source"] = row["gpu_used_mib"], "gpu"  # PID namespace or no per-process figure
        if row["process_mib"] is not None:
            self._snapshot_if_peak(row["process_mib"])
        return row

    def _snapshot_if_peak(self, used_mib: float) -> None:
        """A plain `nvidia-smi` at the peak, retaken only when the peak grows by 1% or more.

        A full snapshot costs several queries; taking one at every small rise during the ramp-up
        would slow the sampling exactly when memory changes fastest.
        """
        if used_mib >= self._peak * 1.01 or self.peak_snapshot is None:
            self._peak = max(self._peak, used_mib)
            self.peak_snapshot = run_nvidia_smi([])

    def summary(self) -> dict[str, Any]:
        """Peak figures for the metrics file; on the CPU the kernel's high-water mark beats sampling."""

        def peak(column: str) -> float | None:
            values = [r[column] for r in self.rows if r[column] is not None]
            return max(values) if values else None

        out: dict[str, Any] = {"samples": len(self.rows), "interval_ms": round(self.interval * 1000)}
        if self.device == "cuda":
            sources = sorted({r["source"] for r in self.rows if r["source"]})
            out.update(
                nvidia_smi_peak_mib=peak("process_mib"),
                nvidia_smi_source="/".join(sources) or None,
                gpu_total_mib=peak("gpu_total_mib"),
            )
        out.update(
            rss_peak_mib=round(max(peak_rss_mib(), peak("rss_mib") or 0.0), 1), sampled_rss_peak_mib=peak("rss_mib")
        )
        if self.errors:
            out["sampler_errors"] = self.errors
        return out
