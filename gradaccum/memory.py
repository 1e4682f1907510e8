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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

MIB = 2**20
# nvidia-smi lists every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, so its rows are matched to
# torch's device by UUID (or PCI bus id), never by index.
GPU_FIELDS = ("index", "uuid", "pci.bus_id", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory")  # nvidia-smi heads the last "used_gpu_memory [MiB]"
TEXT_FIELDS = {"uuid", "gpu_uuid", "pci.bus_id", "name", "driver_version"}  # kept as text; the rest are numbers
TIMELINE_COLUMNS = (
    "seconds",
    "memory_mib",  # the figure the row's source names: what `dvc plots show` draws, one line per variant
    "process_mib",
    "gpu_used_mib",
    "gpu_total_mib",
    "gpu_util_pct",
    "torch_reserved_mib",
    "rss_mib",
    "source",
)


SOURCE_COLUMN = {"rss": "rss_mib", "process": "process_mib", "gpu": "process_mib", "torch": "torch_reserved_mib"}


def with_figure(row: dict[str, Any]) -> dict[str, Any]:
    """The row with `memory_mib`: the device's own figure (nvidia-smi's on a GPU, RSS on a CPU), so a plot of
    one column shows each device's memory and never an empty column drawn as zero."""
    return row | {"memory_mib": row[SOURCE_COLUMN[row["source"]]]}


def query(fields: tuple[str, ...], kind: str = "gpu") -> list[str]:
    return [f"--query-{kind}={','.join(fields)}", "--format=csv,nounits"]


def parse_csv(text: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-... --format=csv[,nounits][,noheader]`, keyed by the fields asked for.

    Keyed by position, because nvidia-smi's header names differ from the query names. Units
    ("7242 MiB", "97 %") are dropped. Anything that is not a number (`[N/A]`, `[Not Supported]`,
    `[Insufficient Permissions]`, an empty field, ...) becomes None, never a made-up 0; identifiers and
    names (TEXT_FIELDS) stay text. A header and no rows (no process on the GPU) gives [].
    """
    rows = []
    for fields_text in csv.reader(io.StringIO(text), skipinitialspace=True):
        values = [v.strip() for v in fields_text]
        if not any(values):
            continue
        if not rows and values[0].split(" [")[0] == fields[0]:
            continue  # the header line: its first name is the one asked for (`index`, `pid`, `name`)
        if len(values) != len(fields):
            raise ValueError(f"nvidia-smi row {values} does not have the {len(fields)} fields {fields}")
        rows.append({f: identifier(v) if f in TEXT_FIELDS else number(v) for f, v in zip(fields, values, strict=True)})
    return rows


def identifier(value: str) -> str | None:
    """An identifier as printed; a marker (`[N/A]`, empty) -> None."""
    return None if is_marker(value) else value


def number(text: str) -> float | None:
    """ "7242 MiB" -> 7242.0; any marker or other text -> None."""
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def is_marker(text: str) -> bool:
    """nvidia-smi's stand-ins for a value it cannot give: `[...]`, `N/A` or an empty field."""
    return text in ("", "N/A") or (text.startswith("[") and text.endswith("]"))


def markers(text: str) -> set[str]:
    """The non-number stand-ins in a CSV answer, to say in the output why a figure is missing."""
    found = set()
    for values in csv.reader(io.StringIO(text), skipinitialspace=True):
        found.update(v.strip() or "(empty)" for v in values if is_marker(v.strip()))
    return found


@dataclass(frozen=True)
class GpuId:
    """Which physical GPU torch's device is, in the terms nvidia-smi prints: its UUID and PCI bus id."""

    uuid: str | None
    pci_bus_id: str | None

    @classmethod
    def of_torch_device(cls, index: int) -> GpuId:
        """torch's device `index` (after CUDA_VISIBLE_DEVICES), from the properties CUDA reports for it."""
        import torch

        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "")) or None
        domain, bus, device = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
        pci = f"{domain:08X}:{bus:02X}:{device:02X}.0" if None not in (domain, bus, device) else None
        return cls(uuid, pci)

    def matches(self, row: dict[str, Any]) -> bool:
        """nvidia-smi's GPU row is this GPU: the same UUID (torch prints it without nvidia-smi's `GPU-`), or,
        where a UUID differs in form (a MIG instance's), the same PCI bus id."""
        if self.uuid and row.get("uuid") and same_uuid(self.uuid, row["uuid"]):
            return True
        return bool(self.pci_bus_id and row.get("pci.bus_id")) and bus_id(self.pci_bus_id) == bus_id(row["pci.bus_id"])


def same_uuid(a: str, b: str) -> bool:
    def bare(u: str) -> str:
        return u.lower().removeprefix("gpu-").removeprefix("mig-")

    return bare(a) == bare(b)


def bus_id(text: str) -> tuple[int, ...]:
    """ "00000000:3B:00.0" and "0000:3b:00.0" alike -> (0, 59, 0, 0)."""
    domain, bus, rest = text.strip().split(":")
    device, function = rest.split(".")
    return tuple(int(x, 16) for x in (domain, bus, device, function))


def run_nvidia_smi(args: list[str], timeout: float = 10.0) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def is_out_of_memory(err: BaseException) -> bool:
    """PyTorch's OutOfMemoryError (GPU), or the CPU allocator's failed malloc, which PyTorch raises as a plain
    RuntimeError: both mean the step did not fit, which is a result, where any other error is a bug."""
    if isinstance(err, MemoryError):
        return True
    cls = type(err).__name__
    return cls == "OutOfMemoryError" or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


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

    device "cuda": this process's memory on `gpu` from nvidia-smi's process list, or that GPU's
    figure when the list does not show our PID (a container's PID namespace), or, when
    nvidia-smi gives no memory figure at all (MIG in an unprivileged pod, WDDM), none: the
    row's source says "torch" and PyTorch's reserved bytes are the only figure. "cpu": RSS.
    `torch_reserved` reads PyTorch's counter (MiB); tests pass a stand-in.
    """

    def __init__(
        self,
        device: str,
        interval_ms: int,
        gpu_index: int = 0,
        torch_reserved: Callable[[], float] | None = None,
        gpu: GpuId | None = None,
    ) -> None:
        self.device, self.interval = device, interval_ms / 1000
        if gpu is None and device == "cuda":
            gpu = GpuId.of_torch_device(gpu_index)
        self.gpu = gpu
        self.rows: list[dict[str, Any]] = []
        self.peak_snapshot: str | None = None  # plain `nvidia-smi` text at the highest reading
        self.errors: list[str] = []
        self.markers: set[str] = set()  # what nvidia-smi printed instead of memory figures
        if torch_reserved is None and device == "cuda":
            import torch

            torch_reserved = lambda: torch.cuda.memory_reserved(gpu_index) / MIB  # noqa: E731
        self.torch_reserved = torch_reserved
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
        if self.torch_reserved is not None:
            row["torch_reserved_mib"] = round(self.torch_reserved(), 1)
        if not self.nvidia_smi:
            row["source"] = "rss" if self.device == "cpu" else "torch"
            return with_figure(row)
        gpu_text = run_nvidia_smi(query(GPU_FIELDS))
        gpus = [g for g in parse_csv(gpu_text, GPU_FIELDS) if self.gpu is not None and self.gpu.matches(g)]
        gpu = gpus[0] if gpus else {}
        if not gpus:  # no figure is better than another GPU's
            self.markers.add(f"no row for torch's GPU ({self.gpu})")
        row.update(
            gpu_used_mib=gpu.get("memory.used"),
            gpu_total_mib=gpu.get("memory.total"),
            gpu_util_pct=gpu.get("utilization.gpu"),
        )
        apps_text = run_nvidia_smi(query(APP_FIELDS, "compute-apps"))
        apps = [a for a in parse_csv(apps_text, APP_FIELDS) if gpu and a["gpu_uuid"] in (None, gpu["uuid"])]
        mine = [a for a in apps if a["pid"] == os.getpid()]
        if mine and mine[0]["used_memory"] is not None:
            row["process_mib"], row["source"] = mine[0]["used_memory"], "process"
        elif row["gpu_used_mib"] is not None:  # PID namespace, or no per-process figure
            row["process_mib"], row["source"] = row["gpu_used_mib"], "gpu"
        else:  # nvidia-smi gave no memory figure at all: no number is made up
            row["source"] = "torch"
            self.markers |= markers(gpu_text) | markers(apps_text)
        if row["process_mib"] is not None:
            self._snapshot_if_peak(row["process_mib"])
        elif self.peak_snapshot is None:
            self.peak_snapshot = run_nvidia_smi([])
        return with_figure(row)

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
                sampled_torch_reserved_peak_mib=peak("torch_reserved_mib"),
            )
            if "torch" in sources:
                shown = ", ".join(sorted(self.markers)) or "nothing (nvidia-smi missing)"
                out["nvidia_smi_fallback"] = (
                    f"nvidia-smi gave no memory figure in {sum(r['source'] == 'torch' for r in self.rows)} of "
                    f"{len(self.rows)} samples (it printed {shown}); PyTorch's reserved memory used there"
                )
        out.update(
            rss_peak_mib=round(max(peak_rss_mib(), peak("rss_mib") or 0.0), 1), sampled_rss_peak_mib=peak("rss_mib")
        )
        if self.errors:
            out["sampler_errors"] = self.errors
        return out


class FirstStepSnapshot:
    """PyTorch's allocator history up to the end of the first optimizer step, dumped for its memory viewer.

    `torch.cuda.memory._record_memory_history` records every allocation with its stack; the pickle
    it dumps opens at https://pytorch.org/memory_viz and shows what holds memory at the peak (the
    activations of one micro-batch, the gradients, AdamW's state). A global optimizer step hook
    fires after the first real step (a step GradScaler skips is not one), so the loop stays as it is.
    `start`, `dump` and `stop` default to PyTorch's CUDA functions; tests pass stand-ins.
    """

    def __init__(
        self,
        path: Path,
        start: Callable[[], None] | None = None,
        dump: Callable[[str], None] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> None:
        import torch

        self.path = path
        self.start = start or (lambda: torch.cuda.memory._record_memory_history(max_entries=200_000))
        self.dump = dump or torch.cuda.memory._dump_snapshot
        self.stop = stop or (lambda: torch.cuda.memory._record_memory_history(enabled=None))
        self.written = False
        self._handle: Any = None

    def __enter__(self) -> FirstStepSnapshot:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.start()
        self._handle = register_optimizer_step_post_hook(self._after_step)
        return self

    def _after_step(self, *_: object) -> None:
        if self.written:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.dump(str(tmp))
        os.replace(tmp, self.path)
        self.written = True
        self._finish()

    def _finish(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self.stop()

    def __exit__(self, *exc: object) -> None:
        self._finish()
