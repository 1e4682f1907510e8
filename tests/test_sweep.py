"""The sweep's points: each in a process of its own, out of memory told apart from every other failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gradaccum import params
from gradaccum.records import Hardware
from gradaccum.refusal import Refused
from gradaccum.spec import sweep_spec
from gradaccum.sweep import SweepError, run_point

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def p() -> params.Params:
    return params.set_values(params.read(ROOT / "params.yaml"), ["memory.sweep_steps=1", "memory.sweep_timeout_s=120"])


def point(p: params.Params, micro: int, checkpointing: bool = False, **kwargs) -> dict:  # noqa: ANN003
    """run_point of the sweep's spec on the CPU scale, as the stage runs it."""
    return run_point(sweep_spec(p, Hardware.nominal("cpu"), checkpointing).at_micro(micro), p.memory, **kwargs)


def python(code: str) -> tuple[str, ...]:
    """A stand-in for the point's command: the arguments run_point adds land in sys.argv, unread."""
    return (sys.executable, "-c", code)


BALLAST_MIB = 600


def test_a_point_measures_its_own_peak(p: params.Params) -> None:
    """The same point with 600 MiB more held by its own process peaks 600 MiB higher: the figure is the
    point's own high-water mark, not a constant, not the parent's, not another point's."""
    row = point(p, 8)
    assert row["fit"] and row["micro_batch"] == 8 and row["checkpointing"] is False and row["images_per_s"] > 0
    assert row["peak_mib"] == row["rss_peak_mib"]  # on a CPU the peak is the kernel's RSS high-water mark
    ballast = python(
        f"import runpy; ballast = b'x' * ({BALLAST_MIB} << 20); "  # written, so every page is resident
        "runpy.run_module('gradaccum.sweep_point', run_name='__main__', alter_sys=True)"
    )
    heavy = point(p, 8, command=ballast)
    assert heavy["peak_mib"] - row["peak_mib"] == pytest.approx(BALLAST_MIB, rel=0.1)


def test_killed_by_the_kernel_is_out_of_memory(p: params.Params) -> None:
    row = point(p, 64, checkpointing=True, command=python("import os, signal; os.kill(os.getpid(), 9)"))
    assert row["fit"] is False and row["micro_batch"] == 64 and row["checkpointing"] is True
    assert "SIGKILL" in row["error"] and row["peak_mib"] is None


def test_a_crash_in_a_point_stops_the_sweep_with_its_traceback(p: params.Params) -> None:
    crash = python("raise RuntimeError('cuDNN exploded')")
    with pytest.raises(SweepError, match=r"(?s)micro-batch 64 failed with exit code 1:\nTraceback.*cuDNN exploded"):
        point(p, 64, command=crash)


def test_a_point_that_refuses_its_model_says_so_in_one_line(p: params.Params) -> None:
    """The real point process: a model that cannot take the images is its one line, not a traceback."""
    vit = params.set_values(p.model_dump(), ["model.name=vit_tiny_patch16_224"])
    with pytest.raises(Refused) as caught:
        point(vit, 64)
    message = str(caught.value)
    assert message.startswith("params.yaml: model.name = 'vit_tiny_patch16_224' cannot take the data's 28x28")
    assert "\n" not in message and "Traceback" not in message


def test_a_point_that_dies_stops_the_sweep(p: params.Params) -> None:
    with pytest.raises(SweepError, match="micro-batch 64 failed with exit code 3:\nout of disk"):
        point(p, 64, command=python("import sys; print('out of disk', file=sys.stderr); sys.exit(3)"))


def test_a_point_that_hangs_times_out(p: params.Params) -> None:
    quick = params.set_values(p.model_dump(), ["memory.sweep_timeout_s=1"])
    with pytest.raises(SweepError, match="still running after memory.sweep_timeout_s = 1"):
        point(quick, 64, command=python("import time; time.sleep(60)"))


def test_a_point_ends_each_pass_with_trainings_short_micro_batch(p: params.Params, monkeypatch) -> None:
    """The allocator's peak depends on the shapes it served: the point trains the epoch's short last one too."""

    from gradaccum import sweep_point

    seen: list[list[int]] = []
    real = sweep_point.train_epoch

    def spy(learner, images, labels, order, plan):  # noqa: ANN001, ANN202
        seen.append([mb.stop - mb.start for mb in plan])
        return real(learner, images, labels, order, plan)

    monkeypatch.setattr(sweep_point, "train_epoch", spy)
    row = sweep_point.measure_point(
        sweep_spec(p, Hardware.nominal("cpu"), False).at_micro(4), 1, test_samples=8, last=3
    )
    assert seen == [[4, 3], [4, 3]] and row["fit"] and row["images_per_s"] > 0


def test_the_sweep_asks_each_point_for_the_training_remainder(p: params.Params, monkeypatch) -> None:
    from gradaccum import sweep

    calls = []

    def fake(spec, memory, test_samples=1000, last=0):  # noqa: ANN001, ANN202
        micro = spec.micro_batch
        calls.append((micro, spec.checkpointing, test_samples, last))
        return {"micro_batch": micro, "checkpointing": spec.checkpointing, "fit": True, "peak_mib": 800.0 + micro}

    monkeypatch.setattr(sweep, "run_point", fake)
    small = params.set_values(
        p.model_dump(), ["scales.cpu.train_samples=1000", "scales.cpu.sweep_micro_batches=[64, 256]"]
    )
    plan = sweep.sweep(small, Hardware.nominal("cpu"), log=lambda _: None)
    assert calls[:2] == [(64, False, 1000, 1000 % 64), (256, False, 1000, 1000 % 256)] and len(calls) == 4
    assert plan.line.per_sample_mib == pytest.approx(1.0) and plan.line.points == [(64, 864), (256, 1056)]
