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
from typing import Any

import psutil

MIB = 2**20
GPU_QUERY = ["--query-gpu=index,memory.used,memory.total,utilization.gpu", "--format=csv,nounits"]
APPS_QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,nounits"]
MISSING = {"[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", ""}
TIMELINE_COLUMNS = ("seconds", "process_mib", "gpu_used_mib", "gpu_total_mib", "gpu_util_pct", "rss_mib", "source")


def parse_csv(text: str) -> list[dict[str, float | None]]:
    """Rows of `nvidia-smi --query-...  --format=csv,nounits` keyed by field name (units dropped).

    `[N/A]` and `[Not Supported]` become None; a header with no rows (no process) gives [].
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    reader = csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True)
    header = [name.split(" [")[0].strip() for name in next(reader)]
    rows = []
    for fields in reader:
        row: dict[str, float | None] = {}
        for name, raw in zip(header, fields, strict=False):
            value = raw.strip()
            row[name] = None if value in MISSING else float(value.split()[0])
        rows.append(row)
    return rows


def run_nvidia_smi(args: list[str], timeout: float = 10.0) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def peak_rss_mib() -> float:
    """The kernel's own high-water mark for this process (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
            self._note_peak(row["rss_mib"], snapshot=False)
            return row
        gpus = [g for g in parse_csv(run_nvidia_smi(GPU_QUERY)) if g.get("index") == self.gpu_index]
        gpu = gpus[0] if gpus else {}
        row.update(
            gpu_used_mib=gpu.get("memory.used"),
            gpu_total_mib=gpu.get("memory.total"),
            gpu_util_pct=gpu.get("utilization.gpu"),
        )
        mine = [a for a in parse_csv(run_nvidia_smi(APPS_QUERY)) if a.get("pid") == os.getpid()]
        if mine and mine[0].get("used_memory") is not None:
            row["process_mib"], row["source"] = mine[0]["used_memory"], "process"
        else:
            row["process_mib"], row["source"] = row["gpu_used_mib"], "gpu"  # PID namespace or no per-process figure
        if row["process_mib"] is not None:
            self._note_peak(row["process_mib"], snapshot=True)
        return row

    def _note_peak(self, value: float, snapshot: bool) -> None:
        if value > self._peak:
            self._peak = value
            if snapshot:
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
