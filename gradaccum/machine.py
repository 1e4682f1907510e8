"""What machine this is: the device, CPU and GPU facts that decide results (the `hardware` stage records them).

torch is imported inside the functions that ask it: `process_seconds` is all the sweep stage's own
process needs, and that process starts in a second without torch (3 s with it).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil


def process_seconds() -> float:
    """Wall time since this process started, imports included: what a stage costs the person waiting for it."""
    return time.time() - psutil.Process().create_time()


def native_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX512-BF16, AMX); without them bfloat16 is emulated, slowly."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def describe(cuda: bool) -> dict[str, Any]:
    """Facts that decide results, and nothing that changes between two runs on one machine."""
    import torch

    info: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu",
        "cpu": {
            "name": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "native_bfloat16": native_bfloat16(),
        },
        "torch": torch.__version__,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "memory_total_mib": props.total_memory // 2**20,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "driver": driver_version(),
            "count": torch.cuda.device_count(),
        }
    return info
