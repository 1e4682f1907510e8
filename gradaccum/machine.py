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


def kernels() -> tuple[str, str | None]:
    """ATen's instruction set, and oneDNN's ceiling where one is set: the kernels a CPU run sums with.

    Float results of two kernels agree only to their precision, so two CPUs (or one held to a smaller set by
    ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2) train to slightly different losses: a record says which.
    """
    import torch

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")  # oneDNN reads either
    return torch.backends.cpu.get_cpu_capability(), (isa.upper() if isa else None)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The oldest Linux driver each CUDA major release runs on (NVIDIA's CUDA Toolkit release notes, "CUDA Minor
# Version Compatibility"): a driver older than this leaves torch.cuda.is_available() False.
MIN_DRIVER = {"13": "580", "12": "525", "11": "450"}


def listed_gpus() -> list[dict[str, str | None]]:
    """The GPUs nvidia-smi lists (name, driver), whether or not torch can use them; [] without nvidia-smi or a
    driver it can talk to."""
    from gradaccum.memory import parse_csv, query, run_nvidia_smi

    fields = ("name", "driver_version")
    if not shutil.which("nvidia-smi"):
        return []
    try:
        return parse_csv(run_nvidia_smi(query(fields), timeout=20), fields)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def unusable_gpu() -> str | None:
    """Why a GPU that nvidia-smi lists is out of torch's reach, with the fix, in one line; None when nvidia-smi
    lists none. Called where torch.cuda.is_available() is False, so the CPU scale does not run in silence."""
    import torch

    gpus = listed_gpus()
    if not gpus:
        return None
    name, driver = gpus[0]["name"] or "a GPU", gpus[0]["driver_version"]
    cuda = torch.version.cuda
    seen = f"nvidia-smi lists {name} (driver {driver or 'unknown'}) but torch {torch.__version__} cannot use it: "
    if cuda is None:
        return seen + "this torch is a CPU build; install one built for CUDA (pytorch.org/get-started) or set scale=cpu"
    need = MIN_DRIVER.get(cuda.split(".")[0])
    if need and driver and int(driver.split(".")[0]) < int(need):
        return (
            seen + f"its wheels are built for CUDA {cuda}, which needs driver {need} or newer. Install a newer NVIDIA "
            "driver, or a torch built for an older CUDA (pip install torch==VERSION --index-url "
            "https://download.pytorch.org/whl/cu126, for example; see pytorch.org/get-started/previous-versions), "
            "or set scale=cpu to train the CPU scale here"
        )
    return (
        seen + f"its wheels are built for CUDA {cuda}, which the driver supports, so the GPU's device files are "
        "likely not visible to this process (a container started without --gpus all, or CUDA_VISIBLE_DEVICES "
        "naming no GPU); fix that, or set scale=cpu to train the CPU scale here"
    )


def describe(cuda: bool) -> dict[str, Any]:
    """Facts that decide results, and nothing that changes between two runs on one machine."""
    import torch

    aten, onednn = kernels()
    info: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu",
        "cpu": {
            "name": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "native_bfloat16": native_bfloat16(),
            "kernels": aten,
            "onednn_max_isa": onednn,
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
            "driver": next((g["driver_version"] for g in listed_gpus()), None),  # one driver serves them all
            "count": torch.cuda.device_count(),
        }
    return info


if __name__ == "__main__":  # the container's entrypoint: said before DVC starts (the hardware stage refuses it)
    import sys

    import torch

    if not torch.cuda.is_available() and (why := unusable_gpu()):
        print(f"note: {why}", file=sys.stderr, flush=True)
