"""The CPU's kernels can be held to a smaller CPU's, and are when asked: `make test-avx2` (in `.ci/run`) reruns
the numerical tests with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, and these tests prove that the
variables took effect in PyTorch and in oneDNN, not only that the run was green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradaccum import machine
from gradaccum.records import Cpu
from gradaccum.report import cpu_kernels

HELD = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# A float32 convolution with oneDNN's verbose log on: its header names the instruction set oneDNN dispatches to,
# read at its first use in a process (so from a fresh one), e.g. "onednn_verbose,v1,info,cpu,isa:Intel AVX2".
PROBE = """
import torch
from gradaccum import machine
torch.nn.functional.conv2d(torch.randn(2, 3, 8, 8), torch.randn(3, 3, 3, 3))  # a size oneDNN takes
print("aten", torch.backends.cpu.get_cpu_capability(), "kernels", *machine.kernels())
"""


def has_avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def probe(env: dict[str, str]) -> tuple[str, str]:
    """(ATen's capability and machine.kernels(), oneDNN's instruction set) in a new process under `env`."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=os.environ | env | {"ONEDNN_VERBOSE": "1"},
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    isa = next(line.split("isa:", 1)[1] for line in lines if ",isa:" in line)
    return next(line for line in lines if line.startswith("aten ")), isa


@pytest.mark.skipif(not has_avx2(), reason="this CPU has no AVX2 to hold the kernels to")
def test_the_variables_hold_both_libraries_to_avx2_and_the_record_says_so() -> None:
    aten, isa = probe(HELD)
    assert aten == "aten AVX2 kernels AVX2 AVX2"
    assert isa == "Intel AVX2"


def test_this_run_has_the_kernels_it_asked_for() -> None:
    """In `make test-avx2` (and any run that sets the variables): the kernels of this very run are the held ones."""
    asked = {k: os.environ[k] for k in HELD if os.environ.get(k)}
    if not asked:
        pytest.skip("the machine's own kernels: neither ATEN_CPU_CAPABILITY nor ONEDNN_MAX_CPU_ISA is set")
    if "ATEN_CPU_CAPABILITY" in asked:
        assert torch.backends.cpu.get_cpu_capability() == asked["ATEN_CPU_CAPABILITY"].upper()
        assert machine.kernels()[0] == asked["ATEN_CPU_CAPABILITY"].upper()
    if "ONEDNN_MAX_CPU_ISA" in asked:
        _, isa = probe({})  # this process's environment, in a fresh process: oneDNN logs its ISA once
        family = asked["ONEDNN_MAX_CPU_ISA"].upper().split("_")[0]  # AVX2, SSE41, AVX512 (of AVX512_CORE)
        assert family in "".join(c for c in isa.upper() if c.isalnum()), isa  # "Intel SSE4.1", "Intel AVX-512 ..."


def test_the_hardware_record_and_the_report_name_the_kernels() -> None:
    """Losses move with the kernels, so the record that decides re-running names them, and the report says them."""
    info = machine.describe(cuda=False)["cpu"]
    assert info["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert info["onednn_max_isa"] == ((os.environ.get("ONEDNN_MAX_CPU_ISA") or "").upper() or None)
    held = Cpu(name="a CPU", native_bfloat16=False, kernels="AVX2", onednn_max_isa="AVX2")
    assert cpu_kernels(held) == ", ATen's AVX2 kernels, oneDNN held to AVX2"
    assert cpu_kernels(Cpu(name="a CPU", native_bfloat16=True)) == ""  # a record made before they were kept
