"""Accumulation across ranks with torchrun + DDP on the CPU (gloo, 2 processes): exact, one all-reduce a window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F
from ddp_worker import CASES, tiny_model, window_data

from gradaccum import params
from gradaccum.accumulation import micro_batch_size, relative_difference, schedule, windows
from gradaccum.loop import normalize
from gradaccum.records import Hardware
from gradaccum.refusal import REFUSED
from gradaccum.spec import check_distributed

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("ddp_worker.py")


def torchrun(mode: str, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, str(WORKER), mode, str(out)], capture_output=True, text=True, env=env, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ddp") / "results.json"
    result = torchrun("gradient", out)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(out.read_text())


def full_batch_gradients(n: int, world: int, accum: int) -> list[torch.Tensor]:
    """Per window of the worker's shuffled epoch, the gradient of the mean loss over its samples in one pass."""
    images, labels, perm = window_data(n)
    spans = [(w[0].start, w[-1].stop) for w in windows(len(perm), micro_batch_size(n, accum * world), accum * world)]
    grads = []
    for a, b in spans:
        model = tiny_model()
        F.cross_entropy(model(normalize(images[perm[a:b]])), labels[perm[a:b]]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return grads


@pytest.mark.parametrize(("n", "accum"), CASES)
def test_ddp_window_gradient_equals_the_full_batch_gradient(ddp_results: dict, n: int, accum: int) -> None:
    """Two ranks, a shuffled epoch of a full window and a short one: each step's averaged gradient is the
    full-batch gradient of the window's shuffled samples (and not of the unshuffled ones)."""
    assert ddp_results["world"] == 2
    full = full_batch_gradients(n, 2, accum)
    found = [r for r in ddp_results["results"] if (r["n"], r["accum"]) == (n, accum)]
    assert sorted(r["no_sync"] for r in found) == [False, True], "the worker did not run this case in both modes"
    for r in found:
        assert len(r["grads"]) == len(full) == 2, r["no_sync"]
        for got, want in zip(r["grads"], full, strict=True):
            assert relative_difference(torch.tensor(got), want) <= 1e-5, r["no_sync"]
    images, labels, _ = window_data(n)
    model = tiny_model()
    F.cross_entropy(model(normalize(images[:n])), labels[:n]).backward()  # the first window, unshuffled
    unshuffled = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert relative_difference(torch.tensor(found[0]["grads"][0]), unshuffled) > 1e-2


@pytest.mark.parametrize(("n", "accum"), CASES)
def test_one_allreduce_per_window_with_no_sync(ddp_results: dict, n: int, accum: int) -> None:
    by_mode = {r["no_sync"]: r for r in ddp_results["results"] if (r["n"], r["accum"]) == (n, accum)}
    assert by_mode[True]["allreduces"] == 2  # two windows
    # rank 0's micro-batches, counted by hand: e.g. (45, 4): 60 samples in micro-batches of 6, windows of 8 and 2
    # micro-batches, of which rank 0 runs 4 and 1
    micro_batches_of_rank0 = {(48, 1): 2, (48, 3): 4, (45, 3): 4, (45, 4): 5}[(n, accum)]
    assert by_mode[False]["allreduces"] == micro_batches_of_rank0  # one per micro-batch without no_sync


def test_a_failing_rank_fails_the_run_and_leaves_no_process(tmp_path: Path) -> None:
    result = torchrun("fail", tmp_path / "unused.json")
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stdout + result.stderr
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(WORKER) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


@pytest.mark.parametrize(("n", "micro", "accum", "world"), [(45, 8, 3, 2), (100, 7, 2, 3), (10, 4, 2, 2), (5, 1, 4, 2)])
def test_rank_weights_average_to_the_window_mean(n: int, micro: int, accum: int, world: int) -> None:
    """DDP averages the ranks' gradients: sum over ranks of weight x samples / world must be each window's mean."""
    plans = [schedule(n, micro, accum, rank=r, world=world) for r in range(world)]
    for w, window in enumerate(windows(n, micro, accum * world)):
        samples = window[-1].stop - window[0].start
        ranks = [[mb for mb in plan if window[0].start <= mb.start < window[-1].stop] for plan in plans]
        counts = [sum(1 for mb in plan if mb.step) for plan in plans]
        assert len(set(counts)) == 1  # every rank steps (all-reduces) in every window
        covered = sorted((mb.start, mb.stop) for mbs in ranks for mb in mbs if mb.weight)
        assert covered == [(mb.start, mb.stop) for mb in window], w  # each sample once, across the ranks
        for mb in (mb for mbs in ranks for mb in mbs if mb.weight):  # DDP divides by world: weight / world = share
            assert mb.weight / world == pytest.approx((mb.stop - mb.start) / samples), w
        assert all(mbs and mbs[-1].step for mbs in ranks), w


def machine(device: str, gpus: int = 0) -> Hardware:
    gpu = {"gpu": {"name": "a GPU", "count": gpus, "memory_total_mib": 81559}} if gpus else {}
    cpu = {"name": "a CPU", "native_bfloat16": True}
    return Hardware.model_validate({"format": 1, "device": device, "scale": "cpu", "cpu": cpu} | gpu)


def test_validation_names_the_keys_when_the_batch_cannot_be_split() -> None:
    raw = params.read(ROOT / "params.yaml")
    raw["distributed"]["nproc_per_node"] = 100
    with pytest.raises(params.ParamsError) as info:
        params.check(raw)
    msg = str(info.value)
    assert "accum x distributed.nproc_per_node = 4 x 100 micro-batches per window" in msg
    assert "effective batch (scales.cpu.batch = 256)" in msg
    raw["distributed"]["nproc_per_node"] = 2
    with pytest.raises(params.ParamsError, match=r"distributed.nproc_per_node = 2 is not allowed; expected at most"):
        check_distributed(params.check(raw), machine("cuda", 1))
    raw["distributed"]["sync_batchnorm"] = True
    p = params.check(raw)
    with pytest.raises(params.ParamsError, match="distributed.sync_batchnorm = True is not allowed; SyncBatchNorm"):
        check_distributed(p, machine("cpu"))
    check_distributed(p, machine("cuda", 2))


def test_hardware_stage_refuses_syncbatchnorm_on_the_cpu_before_any_work(workdir: Path) -> None:
    """The first stage checks the rules that need the machine, so no long stage starts on a doomed setting."""
    from stages import hardware

    text = (workdir / "params.yaml").read_text()
    text = text.replace("nproc_per_node: 1 ", "nproc_per_node: 2 ").replace(
        "sync_batchnorm: false", "sync_batchnorm: true"
    )
    (workdir / "params.yaml").write_text(text)
    with pytest.raises(params.ParamsError, match="distributed.sync_batchnorm = True is not allowed; SyncBatchNorm"):
        hardware.main()
    assert not (workdir / "data/hardware.json").exists()


def test_ctrl_c_while_relaunched_under_torchrun_leaves_no_rank(tmp_path: Path) -> None:
    """The train stage re-launches itself under torchrun; Ctrl-C there must stop the ranks too."""
    import signal
    import time

    (tmp_path / "sleeper.py").write_text(
        "import os, pathlib, time\n"
        "pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", "from gradaccum import distributed; distributed.relaunch(2, 'sleeper', [])"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OUT": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / r).exists() for r in ("0", "1")) and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int((tmp_path / r).read_text()) for r in ("0", "1")]
        parent.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        parent.wait(timeout=120)  # relaunch gives torchrun 30 s, then kills it
        time.sleep(1)
        assert [pid for pid in ranks if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"] == []
    finally:  # a failure here must not leave a child behind for the next test to trip on
        for proc in psutil.Process(parent.pid).children(recursive=True) if parent.poll() is None else []:
            proc.kill()
        parent.kill()
        parent.wait()


RANK_WORKER = """
import sys
from gradaccum import distributed, refusal
rank, _, _ = distributed.setup("cpu")
if rank == 1:
    if sys.argv[1] == "refuse":
        refusal.refuse("params.yaml: scales.cpu.batch = 8192 is not allowed; expected at most 4000")
    raise RuntimeError("rank 1 crashed on purpose")
distributed.all_sum(1.0)  # rank 0 waits here for a rank that is gone
"""
RELAUNCHER = (
    "import sys\n"
    "from gradaccum import distributed, refusal\n"
    "try:\n"
    "    sys.exit(distributed.relaunch(2, 'rank_worker', sys.argv[1:]))\n"
    "except refusal.Refused as err:\n"
    "    refusal.refuse(err)\n"
)


def relaunch_worker(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    """distributed.relaunch of RANK_WORKER, as the train stage relaunches itself, in a process of its own."""
    (tmp_path / "rank_worker.py").write_text(RANK_WORKER)
    return subprocess.run(
        [sys.executable, "-c", RELAUNCHER, mode],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_a_rank_that_refuses_its_input_is_one_line_not_torchruns_traceback(tmp_path: Path) -> None:
    result = relaunch_worker(tmp_path, "refuse")
    assert result.returncode == REFUSED, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: params.yaml: scales.cpu.batch = 8192 is not allowed; expected at most 4000"
    )
    assert "Traceback" not in result.stdout + result.stderr and "ChildFailedError" not in result.stderr


def test_a_rank_that_crashes_shows_its_traceback(tmp_path: Path) -> None:
    result = relaunch_worker(tmp_path, "crash")
    assert result.returncode not in (0, REFUSED)
    assert "Traceback" in result.stderr and "RuntimeError: rank 1 crashed on purpose" in result.stderr
    assert "ChildFailedError" in result.stderr  # torchrun's own report of it comes through


def test_out_of_memory_in_one_rank_of_two_is_a_result(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 of the real train stage under torchrun fails a real allocation (its data capped by setrlimit):
    the stage records "did not fit" and succeeds, like one process out of memory, and no rank is left."""
    from gradaccum import mnist
    from gradaccum.outputs import write_json

    n = 2048  # 1024 images a rank: ~2 GB of activations, over rank 1's cap of 1.25 GiB (0.9 GiB after imports)
    rng = np.random.default_rng(0)
    arrays = {"train_x": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), "train_y": np.arange(n) % 10}
    arrays |= {"test_x": arrays["train_x"][:32], "test_y": arrays["train_y"][:32]}
    mnist.save({k: v.astype(np.uint8) for k, v in arrays.items()}, workdir / "data/dataset.npz")
    write_json(workdir / "data/provenance.json", {"format": 1, "kind": "fallback"})
    write_json(workdir / "data/hardware.json", machine("cpu").model_dump())
    text = (workdir / "params.yaml").read_text().replace("nproc_per_node: 1 ", "nproc_per_node: 2 ")
    text = text.replace("train_samples: 4000", f"train_samples: {n}").replace("batch: 256", f"batch: {n}")
    (workdir / "params.yaml").write_text(text)
    hooks = tmp_path_factory.mktemp("hooks")  # Python imports sitecustomize at start-up, in every rank
    (hooks / "sitecustomize.py").write_text(
        "import os, resource\n"
        "if os.environ.get('RANK') == '1':\n"
        "    resource.setrlimit(resource.RLIMIT_DATA, (1280 * 2**20, 1280 * 2**20))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "stages.train", "baseline"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = json.loads((workdir / "reports/variants/baseline/metrics.json").read_text())
    assert metrics["completed"] is False and metrics["world_size"] == 2
    assert metrics["did_not_fit"]["memory_at_failure_mib"] > 0
    assert (
        "out of memory: " in metrics["did_not_fit"]["reason"]
        and "can't allocate memory" in metrics["did_not_fit"]["reason"]
    )
    assert "recorded as a result" in result.stdout
    ours = (p.info for p in psutil.process_iter(["cmdline", "cwd"]))  # this test's: started in its folder
    leftovers = [p for p in ours if p["cwd"] == str(workdir) and "stages.train" in " ".join(p["cmdline"] or [])]
    assert leftovers == []
