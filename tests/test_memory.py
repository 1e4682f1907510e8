"""The memory sampler: real nvidia-smi text, a fake nvidia-smi on PATH, RSS on the CPU, clean stops."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from gradaccum import memory
from gradaccum.memory import APP_FIELDS, GPU_FIELDS, GpuId, MemorySampler, is_out_of_memory, parse_csv

# As nvidia-smi prints them (driver 5xx): units in the header and the values, "[N/A]" under MIG or
# WDDM, "[Not Supported]" where a board has no such counter, a header alone when no process runs.
UUID0 = "GPU-5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a00"
UUID1 = "GPU-5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a01"
GPU_CSV = f"""index, uuid, pci.bus_id, memory.used [MiB], memory.total [MiB], utilization.gpu [%]
0, {UUID0}, 00000000:18:00.0, 30542 MiB, 81559 MiB, 97 %
1, {UUID1}, 00000000:3B:00.0, 4 MiB, 81559 MiB, 0 %
"""
GPU_CSV_NOUNITS_MIG = f"""index, uuid, pci.bus_id, memory.used [MiB], memory.total [MiB], utilization.gpu [%]
0, {UUID0}, 00000000:18:00.0, 13, 97871, [N/A]
"""
GPU_CSV_NOT_SUPPORTED = f"0, {UUID0}, 00000000:18:00.0, [Not Supported], [Not Supported], 12\n"  # noheader
APPS_CSV = f"""pid, gpu_uuid, used_gpu_memory [MiB]
4135549, {UUID0}, 7242 MiB
80614, {UUID1}, 92908 MiB
"""
APPS_CSV_WDDM = f"""pid, gpu_uuid, used_gpu_memory [MiB]
1584, {UUID0}, [N/A]
"""
APPS_CSV_EMPTY = "pid, gpu_uuid, used_gpu_memory [MiB]\n"


def test_parse_gpu_rows_with_units() -> None:
    rows = parse_csv(GPU_CSV, GPU_FIELDS)
    assert rows == [
        {"index": 0.0, "uuid": UUID0, "pci.bus_id": "00000000:18:00.0", "memory.used": 30542.0, "memory.total": 81559.0,
         "utilization.gpu": 97.0},
        {"index": 1.0, "uuid": UUID1, "pci.bus_id": "00000000:3B:00.0", "memory.used": 4.0, "memory.total": 81559.0,
         "utilization.gpu": 0.0},
    ]  # fmt: skip


def test_parse_not_available_and_not_supported() -> None:
    assert parse_csv(GPU_CSV_NOUNITS_MIG, GPU_FIELDS)[0]["utilization.gpu"] is None
    row = parse_csv(GPU_CSV_NOT_SUPPORTED, GPU_FIELDS)[0]
    assert row["memory.used"] is None and row["memory.total"] is None and row["utilization.gpu"] == 12.0
    assert parse_csv(APPS_CSV_WDDM, APP_FIELDS) == [{"pid": 1584.0, "gpu_uuid": UUID0, "used_memory": None}]


def test_parse_process_list() -> None:
    assert parse_csv(APPS_CSV, APP_FIELDS)[1] == {"pid": 80614.0, "gpu_uuid": UUID1, "used_memory": 92908.0}
    assert parse_csv(APPS_CSV_EMPTY, APP_FIELDS) == []
    assert parse_csv("", APP_FIELDS) == []


def test_parse_rejects_a_row_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="does not have the 3 fields"):
        parse_csv("pid, gpu_uuid, used_gpu_memory [MiB]\n1, 2\n", APP_FIELDS)


# A stand-in for nvidia-smi, from ../shared/nvidia-smi-facts.md: it answers the sampler's two CSV queries
# and the plain snapshot. Like the real one it lists every GPU of the machine, whatever CUDA_VISIBLE_DEVICES
# says. FAKE_MODE picks what a real driver printed:
#   (unset)    one GPU, our PID listed with its memory (bare metal)
#   four       four GPUs, ours the third (CUDA_VISIBLE_DEVICES=2): GPU 0 busy with another process
#   container  the process list is empty although memory is in use (PID namespace)
#   mig-pod    A100 MIG in an unprivileged pod: every memory field [Insufficient Permissions], utilization [N/A]
#   wddm       Windows WDDM: per-process used_gpu_memory [N/A]
#   odd        the other markers: [Requested functionality has been deprecated], [Unknown Error], an empty field
FAKE = """#!/usr/bin/env bash
echo $$ >> "{log}"
sleep 0.05
used=$((1000 + RANDOM % 100)); mine=$((700 + RANDOM % 100))
u=GPU-5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a0
case "$1" in
  --query-gpu=*) echo "index, uuid, pci.bus_id, memory.used [MiB], memory.total [MiB], utilization.gpu [%]"
    case "$FAKE_MODE" in
      mig-pod) echo "0, ${{u}}0, 00000000:18:00.0, [Insufficient Permissions], [Insufficient Permissions], [N/A]" ;;
      odd)     echo "0, ${{u}}0, 00000000:18:00.0, [Requested functionality has been deprecated], , [Unknown Error]" ;;
      four)    echo "0, ${{u}}0, 00000000:18:00.0, 70000, 81559, 99"
               echo "1, ${{u}}1, 00000000:2A:00.0, 4, 81559, 0"
               echo "2, ${{u}}2, 00000000:3B:00.0, $used, 81559, 50"
               echo "3, ${{u}}3, 00000000:5D:00.0, 4, 81559, 0" ;;
      *)       echo "0, ${{u}}0, 00000000:18:00.0, $used, 81559, 50" ;;
    esac ;;
  --query-compute-apps=*) echo "pid, gpu_uuid, used_gpu_memory [MiB]"
    case "$FAKE_MODE" in
      container) ;;
      mig-pod)   echo "$PPID, ${{u}}0, [Insufficient Permissions]" ;;
      wddm|odd)  echo "$PPID, ${{u}}0, [N/A]"; echo "1584, ${{u}}0, [N/A]" ;;
      four)      echo "1, ${{u}}0, 69000"; echo "$PPID, ${{u}}2, $mine" ;;
      *)         echo "1, ${{u}}0, 5"; echo "$PPID, ${{u}}0, $mine" ;;  # another process listed first
    esac ;;
  "") echo "+---- NVIDIA-SMI 999.99 fake ----+" ;;
  *) echo "unexpected $*" >&2; exit 3 ;;
esac
"""
FAKE_GPU = GpuId("5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a00", "00000000:18:00.0")  # torch's device 0, as torch names it


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "calls.log"
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(FAKE.format(log=log))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def no_orphans(log: Path) -> None:
    pids = [int(p) for p in log.read_text().split()]
    assert pids, "the fake nvidia-smi was never called"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert psutil.Process().children() == []


def test_sampler_reads_this_process_from_fake_nvidia_smi(fake_nvidia_smi: Path) -> None:
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=FAKE_GPU) as sampler:
        time.sleep(0.6)
    assert len(sampler.rows) >= 3
    assert all(r["source"] == "process" and 700 <= r["process_mib"] < 800 for r in sampler.rows)
    assert all(r["memory_mib"] == r["process_mib"] for r in sampler.rows)  # what dvc plots draws: nvidia-smi's
    assert all(1000 <= r["gpu_used_mib"] < 1100 and r["gpu_total_mib"] == 81559 for r in sampler.rows)
    assert sampler.peak_snapshot and "NVIDIA-SMI" in sampler.peak_snapshot
    summary = sampler.summary()
    assert summary["nvidia_smi_peak_mib"] == max(r["process_mib"] for r in sampler.rows)
    assert summary["nvidia_smi_source"] == "process"
    no_orphans(fake_nvidia_smi)


class ThirdGpuProperties:
    """What torch.cuda.get_device_properties(0) gives under CUDA_VISIBLE_DEVICES=2: the machine's third GPU."""

    uuid = "5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a02"  # torch prints it without nvidia-smi's "GPU-"
    pci_domain_id, pci_bus_id, pci_device_id = 0, 0x3B, 0


def test_sampler_reads_torchs_gpu_not_nvidia_smis_first(
    fake_nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four GPUs, CUDA_VISIBLE_DEVICES naming the third: torch's device 0 is nvidia-smi's index 2, and GPU 0
    (70000 MiB used by another process) is not ours."""
    import torch

    monkeypatch.setenv("FAKE_MODE", "four")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: ThirdGpuProperties())
    gpu = GpuId.of_torch_device(0)
    assert gpu == GpuId("5c1cfbb6-8e2e-1b0c-7a3f-0d9e3f2b1a02", "00000000:3B:00.0")
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved) as sampler:
        time.sleep(0.3)
    assert sampler.rows and all(r["source"] == "process" and 700 <= r["process_mib"] < 800 for r in sampler.rows)
    assert all(1000 <= r["gpu_used_mib"] < 1100 and r["gpu_util_pct"] == 50 for r in sampler.rows)


def test_a_mig_instance_is_matched_by_its_pci_bus_id(fake_nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG instance's UUID is not its GPU's; the bus id still names the board (written as nvidia-smi's older
    drivers and lspci do)."""
    monkeypatch.setenv("FAKE_MODE", "four")
    gpu = GpuId("MIG-1b2c3d4e-0000-5555-aaaa-0123456789ab", "0000:3b:00.0")
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=gpu) as sampler:
        time.sleep(0.3)
    assert sampler.rows and all(1000 <= r["gpu_used_mib"] < 1100 for r in sampler.rows)


def test_no_row_for_our_gpu_gives_no_figure_rather_than_anothers(
    fake_nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "four")
    gpu = GpuId("5c1cfbb6-0000-0000-0000-000000000009", "00000000:99:00.0")
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=gpu) as sampler:
        time.sleep(0.3)
    assert sampler.rows and all(r["source"] == "torch" and r["gpu_used_mib"] is None for r in sampler.rows)
    assert "no row for torch's GPU" in sampler.summary()["nvidia_smi_fallback"]


def fake_torch_reserved() -> float:
    return 512.0


@pytest.mark.parametrize("mode", ["container", "wddm"])
def test_sampler_falls_back_to_gpu_wide_figure(
    fake_nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("FAKE_MODE", mode)  # our PID not listed, or listed without a figure
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=FAKE_GPU) as sampler:
        time.sleep(0.3)
    assert sampler.rows and all(r["source"] == "gpu" and r["process_mib"] == r["gpu_used_mib"] for r in sampler.rows)
    summary = sampler.summary()
    assert summary["nvidia_smi_source"] == "gpu" and "nvidia_smi_fallback" not in summary
    assert 1000 <= summary["nvidia_smi_peak_mib"] < 1100


@pytest.mark.parametrize(
    ("mode", "shown"),
    [
        ("mig-pod", "[Insufficient Permissions], [N/A]"),
        ("odd", "(empty), [N/A], [Requested functionality has been deprecated], [Unknown Error]"),
    ],
)
def test_sampler_without_any_memory_figure_uses_torch_and_says_so(
    fake_nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch, mode: str, shown: str
) -> None:
    monkeypatch.setenv("FAKE_MODE", mode)
    with MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=FAKE_GPU) as sampler:
        time.sleep(0.3)
    assert sampler.rows and not sampler.errors
    assert all(r["source"] == "torch" and r["process_mib"] is None and r["gpu_used_mib"] is None for r in sampler.rows)
    assert all(r["torch_reserved_mib"] == 512.0 == r["memory_mib"] for r in sampler.rows)
    summary = sampler.summary()
    assert summary["nvidia_smi_peak_mib"] is None and summary["nvidia_smi_source"] == "torch"  # no invented number
    assert summary["sampled_torch_reserved_peak_mib"] == 512.0
    assert f"it printed {shown}); PyTorch's reserved memory used there" in summary["nvidia_smi_fallback"]
    assert sampler.peak_snapshot and "NVIDIA-SMI" in sampler.peak_snapshot
    no_orphans(fake_nvidia_smi)


def test_parse_every_marker_from_the_facts_as_missing() -> None:
    text = "index, uuid, pci.bus_id, memory.used [MiB], memory.total [MiB], utilization.gpu [%]\n"
    text += "0, [N/A], , [Insufficient Permissions], , [N/A]\n"
    assert parse_csv(text, GPU_FIELDS) == [
        {"index": 0.0, "uuid": None, "pci.bus_id": None, "memory.used": None, "memory.total": None,
         "utilization.gpu": None}
    ]  # fmt: skip
    text = f"0, {UUID0}, 00000000:18:00.0, [Requested functionality has been deprecated], [Unknown Error], "
    text += "[Not Supported]\n"  # noheader
    assert parse_csv(text, GPU_FIELDS)[0]["memory.used"] is None
    assert memory.markers(text) == {
        "[Requested functionality has been deprecated]",
        "[Unknown Error]",
        "[Not Supported]",
    }


@pytest.mark.parametrize("error", [RuntimeError("training failed"), KeyboardInterrupt()])
def test_sampler_stops_on_exception_and_ctrl_c(fake_nvidia_smi: Path, error: BaseException) -> None:
    with pytest.raises(type(error)):
        with MemorySampler("cuda", interval_ms=20, torch_reserved=fake_torch_reserved, gpu=FAKE_GPU) as sampler:
            time.sleep(0.2)
            raise error
    assert sampler._thread is None and not any(t.name == "memory-sampler" for t in __import__("threading").enumerate())
    no_orphans(fake_nvidia_smi)


def test_missing_nvidia_smi_warns_and_records_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.warns(UserWarning, match="nvidia-smi not on PATH"):
        sampler = MemorySampler("cuda", interval_ms=50, torch_reserved=fake_torch_reserved, gpu=FAKE_GPU)
    with sampler:
        time.sleep(0.2)
    assert sampler.rows and all(r["source"] == "torch" and r["torch_reserved_mib"] == 512.0 for r in sampler.rows)
    assert "nvidia-smi missing" in sampler.summary()["nvidia_smi_fallback"]


def test_rss_sampler_sees_an_allocation() -> None:
    with MemorySampler("cpu", interval_ms=20) as sampler:
        time.sleep(0.1)
        block = bytearray(300 * memory.MIB)
        block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
        time.sleep(0.2)
        del block
    rss = [r["rss_mib"] for r in sampler.rows]
    assert max(rss) - rss[0] > 250
    summary = sampler.summary()
    assert summary["rss_peak_mib"] >= max(rss) and "nvidia_smi_peak_mib" not in summary
    assert all(r["source"] == "rss" and r["memory_mib"] == r["rss_mib"] for r in sampler.rows)


def test_peak_rss_of_a_child_is_its_own_not_its_parents() -> None:
    """getrusage's ru_maxrss survives fork and exec; the sweep's points and DVC's stages are children."""
    import subprocess
    import sys

    block = bytearray(600 * memory.MIB)
    block[::4096] = b"x" * len(block[::4096])
    code = "from gradaccum.memory import peak_rss_mib; print(peak_rss_mib())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert memory.peak_rss_mib() > 600 and child < 300
    del block


def test_first_step_snapshot_is_dumped_once_after_the_first_real_step(tmp_path: Path) -> None:
    """The memory history ends at the first optimizer step; a step GradScaler skips is not one."""
    import torch

    events: list[str] = []

    def dump(path: str) -> None:
        events.append("dump")
        Path(path).write_bytes(b"pickle")

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    target = tmp_path / "variants/baseline/memory_snapshot.pickle"
    snapshot = memory.FirstStepSnapshot(
        target, start=lambda: events.append("start"), dump=dump, stop=lambda: events.append("stop")
    )
    scaler = torch.amp.GradScaler("cpu")
    with snapshot:
        scaler.scale(model(torch.full((3, 4), float("inf"))).sum()).backward()  # inf gradients
        scaler.step(opt)  # GradScaler skips this step
        scaler.update()
        assert events == ["start"] and not target.exists()  # no real step yet: nothing dumped
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert events == ["start", "dump", "stop"]
        opt.step()
    assert events == ["start", "dump", "stop"] and target.read_bytes() == b"pickle"
    assert not list(target.parent.glob("*.tmp"))
    opt.step()  # the hook is gone
    assert events == ["start", "dump", "stop"]


def test_first_step_snapshot_stops_recording_when_no_step_ran(tmp_path: Path) -> None:
    events: list[str] = []
    with pytest.raises(RuntimeError):
        with memory.FirstStepSnapshot(
            tmp_path / "s.pickle",
            start=lambda: events.append("start"),
            dump=lambda p: events.append("dump"),
            stop=lambda: events.append("stop"),
        ):
            raise RuntimeError("out of memory before the first step")
    assert events == ["start", "stop"] and not (tmp_path / "s.pickle").exists()


def test_a_failed_allocation_is_out_of_memory_and_other_errors_are_not() -> None:
    """On the CPU PyTorch raises a failed malloc as a plain RuntimeError; it must count as out of memory."""
    import torch

    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: the kernel refuses it
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB"))
    with pytest.raises(RuntimeError) as shapes:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert not is_out_of_memory(shapes.value)
    assert not is_out_of_memory(ValueError("can't allocate memory"))
