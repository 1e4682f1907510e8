"""The traced peak (fake tensors, PyTorch's MemTracker) against a hand count and against real allocations."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType

from gradaccum import models, params, study_trace, trace
from gradaccum.loop import normalize
from gradaccum.memory import MIB
from gradaccum.models import spec_model

ROOT = Path(__file__).resolve().parent.parent
PIXELS, CLASSES = 28 * 28, 1000
P = PIXELS * CLASSES * 4  # the linear model's float32 weight, in bytes


def linear() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(PIXELS, CLASSES, bias=False))


def test_the_private_api_the_trace_reads_is_still_there() -> None:
    """MemTracker is private: these are the names gradaccum/trace.py relies on."""
    assert {kind.value for kind in _MemRefType} == set(trace.TRACKER_KINDS) and _TOTAL_KEY == "Total"
    tracker = trace.PeakTracker()
    assert isinstance(tracker, MemTracker) and tracker._peak_mem == {} and tracker._curr_mem_snap == {}
    assert callable(MemTracker._update_peak_stats) and callable(tracker.get_tracker_snapshot)
    assert {u.name for u in _UpdateType} == {"ADD", "DEL", "REF", "SIZE"} and callable(MemTracker._update_snap)


def test_a_linear_models_step_traces_to_the_hand_count() -> None:
    """Micro-batch 1, the CPU's rules: the peak is in AdamW's step: weight, gradient, two moments, two temporaries
    of the weight's size (the CPU's one-tensor loop: the second moment's square root, then that over the bias
    correction), the step counter (4 bytes), and the resident data. CUDA's foreach: tests/test_allocator.py."""
    data = 1000
    r = trace.trace_step(trace.TracedStep(build=linear, micro=1, accum=2, num_classes=10, dtype=None, resident=data))
    assert r["parameters_mib"] * MIB == P and r["gradients_mib"] * MIB == P and r["data_mib"] * MIB == data * PIXELS
    assert r["optimizer_mib"] * MIB == 4 * P + 4
    assert r["peak_mib"] * MIB == 6 * P + 4 + data * PIXELS


def test_a_linear_models_activations_are_the_tensors_backward_needs() -> None:
    """Micro-batch m: the uint8 images, the normalised input the linear layer saves, the logits, the labels,
    and the two scalars (loss, its weighting) live at the peak in backward."""
    m = 512
    r = trace.trace_step(trace.TracedStep(build=linear, micro=m, accum=2, num_classes=10, dtype=None))
    assert r["activations_mib"] * MIB == m * PIXELS + m * PIXELS * 4 + m * CLASSES * 4 + m * 8 + 8


def test_the_real_allocators_peak_equals_the_trace() -> None:
    """The same step on real CPU tensors, every allocation recorded by the profiler: not a byte apart."""
    traced = trace.trace_step(
        trace.TracedStep(build=linear, micro=512, accum=2, num_classes=10, dtype=None, resident=100)
    )["peak_mib"]
    assert (
        trace.allocated_peak_mib(
            trace.TracedStep(build=linear, micro=512, accum=2, num_classes=10, dtype=None, resident=100)
        )
        == traced
    )


def test_efficientnet_at_the_cpu_scale_is_within_1pct_of_real_allocations() -> None:
    p = params.load(ROOT / "params.yaml")
    build = partial(spec_model, trace.traced_spec(p, "accumulation", "cpu"))
    traced = trace.trace_step(trace.TracedStep(build=build, micro=64, accum=4, num_classes=10, dtype=None))["peak_mib"]
    assert traced == pytest.approx(
        trace.allocated_peak_mib(trace.TracedStep(build=build, micro=64, accum=4, num_classes=10, dtype=None)), rel=0.01
    )


def test_the_traced_peak_is_a_line_in_the_micro_batch_once_backward_sets_it() -> None:
    """Below ~400 samples the linear model's peak is AdamW's step (flat), above it backward's (growing):
    two sizes in the growing part give the line exactly; the chord over both parts lies above the peak."""

    def traced(micro: int) -> dict:
        return trace.trace_step(trace.TracedStep(build=linear, micro=micro, accum=2, num_classes=10, dtype=None))

    predict = trace.peak_line((1024, 4096), (traced(1024), traced(4096)))
    assert predict.fixed_mib + predict.per_sample_mib * 2048 == pytest.approx(traced(2048)["peak_mib"], rel=1e-9)
    chord = trace.peak_line((1, 1024), (traced(1), traced(1024)))
    assert chord.fixed_mib + chord.per_sample_mib * 256 >= traced(256)["peak_mib"]


def test_float16_autocast_halves_what_the_convolutions_keep() -> None:
    """Under the CPU's float16 autocast every map autograd saves is float16 (counted here by a saved-tensor
    hook, apart from the trace: float32 under 0.5% of the bytes), so the traced activations are half of
    float32's and a little more (measured 0.523); an autocast that left the norms' maps in float32, as
    CUDA's does, would give about 0.85."""
    p = params.load(ROOT / "params.yaml")
    build = partial(spec_model, trace.traced_spec(p, "groupnorm", "study"))
    saved: dict[torch.dtype, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.dtype] = saved.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    images = torch.randint(0, 256, (32, 28, 28), dtype=torch.uint8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.float16):
        build()(normalize(images)).float().sum()
    assert saved.get(torch.float32, 0) < 0.005 * saved[torch.float16]
    full = trace.trace_step(trace.TracedStep(build=build, micro=256, accum=1, num_classes=10, dtype=None))[
        "activations_mib"
    ]
    half = trace.trace_step(trace.TracedStep(build=build, micro=256, accum=1, num_classes=10, dtype=torch.float16))[
        "activations_mib"
    ]
    assert 0.5 <= half / full < 0.55


def test_a_model_that_cannot_take_the_images_is_refused_by_name() -> None:
    raw = params.read(ROOT / "params.yaml")
    vit = params.set_values(raw, ["model.name=vit_tiny_patch16_224"])
    with pytest.raises(
        models.ModelInputError, match=r"model.name = 'vit_tiny_patch16_224' cannot take the data's 28x28"
    ):
        models.check_input(vit.model)
    resnet = params.set_values(raw, ["model.name=resnet18"])
    models.check_input(resnet.model)  # any model that takes them passes


def test_the_tutorials_settings_are_its_own_whatever_params_say() -> None:
    """The trace stage traces the tutorial's claims at 4 x 8192 of 32768 even after `dvc exp run -S accum=8`."""
    p = params.set_values(params.read(ROOT / "params.yaml"), ["accum=8", "scales.study.batch=4096"])
    t = study_trace.tutorial_settings(p)
    assert (t.accum, t.scales.study.batch) == (4, 32768)
    assert [trace.traced_spec(t, v, "study").accum for v in ("tutorial_accumulation", "baseline")] == [4, 1]
    assert t.variants == p.variants and t.model == p.model
