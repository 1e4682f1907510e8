"""CUDA's autocast policy, emulated on CPU tensors for the GPU traces, against PyTorch's own lists and kernels."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from timm.layers import is_fast_norm
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum import autocast_policy, params, trace
from gradaccum.memory import MIB
from gradaccum.models import spec_model
from gradaccum.refusal import BadInput

ROOT = Path(__file__).resolve().parent.parent
HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def header_list(macro: str) -> list[str]:
    """The ops of one AT_FORALL_* macro in the installed torch's autocast_mode.h, as name.overload."""
    text = HEADER.read_text()
    body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S)
    assert body, f"{macro} not in {HEADER}"
    entries = re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1))
    return [f"{name}.{overload}" if overload else name for name, overload in entries]


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships without its C++ headers")
def test_the_lists_are_the_installed_torchs_header() -> None:
    """An upgrade that moves an op between CUDA's lists fails here, naming the list."""
    assert list(autocast_policy.LOWER_PRECISION_FP) == header_list("AT_FORALL_LOWER_PRECISION_FP")
    assert list(autocast_policy.FP32) == header_list("AT_FORALL_FP32")
    assert list(autocast_policy.FP32_SET_OPT_DTYPE) == header_list("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert list(autocast_policy.PROMOTE) == header_list("AT_FORALL_PROMOTE")
    redispatch = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", HEADER.read_text(), re.S)
    assert redispatch and re.findall(r'"([\w.]+)"', redispatch.group(1)) == list(autocast_policy.FP32_APPEND_DTYPE)


def test_the_lists_are_the_dispatchers_cuda_kernels() -> None:
    """The ops this torch registers on AutocastCUDA are exactly the listed ones (the check cuda_policy runs)."""
    assert torch.__version__.split("+")[0] == autocast_policy.PINNED_TORCH
    assert autocast_policy.registered("AutocastCUDA") == set(autocast_policy.POLICIES)
    assert not autocast_policy.difference()


def as_torch_2_11(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch's dispatcher answering as torch 2.11's does: no AutocastCUDA kernel for rms_norm."""
    real = autocast_policy.registered
    monkeypatch.setattr(
        autocast_policy, "registered", lambda key: real(key) - ({"rms_norm"} if key == "AutocastCUDA" else set())
    )


def test_a_torch_without_one_listed_op_traces_a_model_that_never_calls_it(monkeypatch: pytest.MonkeyPatch) -> None:
    as_torch_2_11(monkeypatch)
    assert autocast_policy.difference().gone == ("rms_norm",)
    p = params.set_values(params.read(ROOT / "params.yaml"), ["scales.study.batch=64"])
    row = trace.trace_variant(p, "accumulation", "study")
    assert row["peak_mib"] > 0 and "gpu_nvidia_smi_mib" in row
    assert row["autocast_policy"] == (
        f"CUDA's (torch 2.14.1 lists, emulated on the CPU); torch {torch.__version__}'s CUDA autocast lists differ "
        "from torch 2.14.1's: it lacks rms_norm, and this step calls none of those ops"
    )


def test_a_model_calling_a_differing_op_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    as_torch_2_11(monkeypatch)

    def build() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.RMSNorm(8))

    with pytest.raises(autocast_policy.PolicyMismatch, match=r"calls aten::rms_norm, and torch .* lacks rms_norm"):
        trace.trace_step(
            trace.TracedStep(build=build, micro=4, accum=1, num_classes=8, dtype=torch.float16),
            policy=autocast_policy.CUDA,
        )
    assert (
        trace.trace_step(trace.TracedStep(build=build, micro=4, accum=1, num_classes=8, dtype=torch.float16))[
            "peak_mib"
        ]
        > 0
    )  # the CPU's rules: no question arises
    monkeypatch.setattr(autocast_policy, "POLICIES", {k: v for k, v in autocast_policy.POLICIES.items() if k != "exp"})
    with autocast_policy.cuda_policy() as diff, torch.autocast("cpu", dtype=torch.float16):
        assert diff.new == ("exp",)
        with pytest.raises(autocast_policy.PolicyMismatch, match=r"calls aten::exp, and .* adds exp"):
            torch.randn(3).exp()
    assert torch.randn(3).exp().dtype == torch.float32  # outside, nothing is left registered


def run_ops() -> tuple[torch.dtype, ...]:
    x, w = torch.randn(2, 8, 5, 5), torch.randn(8, 8, 3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = F.conv2d(x, w)
        g = F.group_norm(y, 1)
        outs = (y, g, F.layer_norm(y, y.shape[1:]), F.softmax(g.flatten(1), 1), g.sum(), torch.cat([y, y]))
    return tuple(t.dtype for t in outs)


def test_inside_cuda_policy_the_norms_and_softmax_run_in_float32_and_outside_the_cpus_policy_is_back() -> None:
    half, full = torch.float16, torch.float32
    cpu = (half, half, half, half, half, half)  # CPU autocast lists neither norm nor softmax nor sum
    assert run_ops() == cpu
    with autocast_policy.cuda_policy():
        assert run_ops() == (half, full, full, full, full, half)  # cat is CPU-only: falls through, as on CUDA
    assert run_ops() == cpu


class FunctionLog(TorchFunctionMode):
    """Every torch function called, with its outputs' dtypes: the same calls on either device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        dtypes = tuple(str(o.dtype) for o in outs if isinstance(o, torch.Tensor))
        if dtypes:
            self.calls.append((getattr(func, "__name__", str(func)), dtypes))
        return out


@contextlib.contextmanager
def real_cuda_autocast() -> Iterator[None]:
    """PyTorch's own CUDA autocast kernels, switched on directly: torch.autocast("cuda") disables itself
    without a GPU, but fake CUDA tensors run a forward through the AutocastCUDA key all the same."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)


def forward_calls(build: Any, device: str, rules: str) -> list[tuple[str, tuple[str, ...]]]:
    """The study step's forward and loss on fake tensors on `device`, under `rules`' autocast."""
    emulate = autocast_policy.cuda_policy() if rules == "emulated" else contextlib.nullcontext()
    with emulate, FakeTensorMode():
        with torch.device(device):
            model = build()
            images, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
        autocast = real_cuda_autocast() if device == "cuda" else torch.autocast("cpu", dtype=torch.float16)
        with autocast, FunctionLog() as log:
            F.cross_entropy(model(images), labels)
    return log.calls


@pytest.mark.parametrize("variant", ["baseline", "accumulation", "tutorial_accumulation", "accum_checkpointing"])
def test_every_call_of_the_study_models_gets_the_dtype_cuda_autocast_gives_it(variant: str) -> None:
    """Both norms, both swaps, checkpointing: call by call, the emulation's output dtypes are those of PyTorch's
    real CUDA autocast kernels (on fake CUDA tensors); the CPU's own policy differs wherever GroupNorm runs."""
    build = partial(spec_model, trace.traced_spec(params.load(ROOT / "params.yaml"), variant, "study"))
    cuda = forward_calls(build, "cuda", "real")
    assert forward_calls(build, "cpu", "emulated") == cuda
    norms = {dtypes for name, dtypes in cuda if name in ("group_norm", "batch_norm")}
    if "group_norm" in {name for name, _ in cuda}:
        assert norms == {("torch.float32",)}
        assert forward_calls(build, "cpu", "cpu") != cuda
    else:
        assert norms == {("torch.float16",)}  # batch_norm is in no list: the input's float16


def test_checkpointings_recompute_in_backward_keeps_cudas_policy() -> None:
    build = partial(spec_model, trace.traced_spec(params.load(ROOT / "params.yaml"), "accum_checkpointing", "study"))
    with autocast_policy.cuda_policy(), FakeTensorMode():
        model = build()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,)))
        with DispatchLog() as log:
            loss.backward()
    recomputed = [out.dtype for name, out in log.calls if name == "aten.native_group_norm.default"]
    assert len(recomputed) > 40 and set(recomputed) == {torch.float32}  # the blocks' norms, run again


class DispatchLog(TorchDispatchMode):
    """Every aten op below autograd, with its first output: what backward (and a recompute in it) runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((str(func), out[0] if isinstance(out, (tuple, list)) else out))
        return out


def norm_model(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.GroupNorm(1, channels),
        nn.SiLU(),
        nn.Flatten(),
        nn.Linear(channels * 28 * 28, 10, bias=False),
    )


def test_a_groupnorm_model_traced_under_cudas_policy_counts_float32_where_cuda_saves_it() -> None:
    """conv -> GroupNorm -> SiLU -> linear, n = micro x channels x 28 x 28 values a map. CUDA saves the norm's
    float32 copy of the conv output and the norm's float32 output (SiLU's input), the CPU float16 maps.
    Under CUDA's policy the peak is SiLU's backward: those two float32 maps (8n bytes of activations, beside
    the uint8 images and the conv's float16 copy of the input) and two float32 gradients of a map (8n of
    temporaries); the CPU's policy holds float16 maps there instead, less in all."""
    micro, channels = 64, 32
    n = micro * channels * 28 * 28

    def traced(policy: str) -> dict[str, float]:
        return trace.trace_step(
            trace.TracedStep(
                build=lambda: norm_model(channels), micro=micro, accum=2, num_classes=10, dtype=torch.float16
            ),
            policy=policy,
        )

    cuda, cpu = traced(autocast_policy.CUDA), traced(autocast_policy.CPU)
    assert cuda["temporaries_mib"] * MIB == 8 * n
    images = micro * 28 * 28 * (1 + 2)  # uint8, and the float16 copy the conv saves
    assert 0 <= cuda["activations_mib"] * MIB - 8 * n - images < micro * 10 * 4  # logits and loss: bytes a sample
    assert cpu["activations_mib"] * MIB < 3 * n and cpu["peak_mib"] < cuda["peak_mib"] - 5 * n / MIB


def test_the_study_traces_record_cudas_policy_and_the_cpu_scale_its_own() -> None:
    p = params.set_values(params.read(ROOT / "params.yaml"), ["scales.study.batch=64", "train.amp_cpu=bfloat16"])
    study, cpu = (trace.trace_variant(p, "accumulation", scale) for scale in ("study", "cpu"))
    assert study["autocast_policy"] == "CUDA's (torch 2.14.1 lists, emulated on the CPU)"  # no difference named
    assert cpu["autocast_policy"] == "the CPU's" and cpu["amp"] == "bfloat16"
    float32 = trace.trace_variant(p, "groupnorm_precision", "study")
    assert float32["autocast_policy"] == "none (float32, no autocast)"


def test_timms_fast_norm_brings_groupnorm_back_to_batchnorms_memory_under_cudas_rules() -> None:
    """The lever against GroupNorm's float32: with timm.layers.set_fast_norm the GroupNormAct layers run in
    float16, and the step keeps what the BatchNorm model keeps at the same micro-batch; the switch is put back."""
    p = params.set_values(params.read(ROOT / "params.yaml"), ["scales.study.batch=256"])
    group, fast, batch = (
        trace.trace_variant(p, v, "study", fast_norm=f)
        for v, f in (("accumulation", False), ("accumulation", True), ("accum_batchnorm", False))
    )
    assert fast["fast_norm"] and fast["activations_mib"] < 0.7 * group["activations_mib"]
    assert fast["activations_mib"] == pytest.approx(batch["activations_mib"], rel=0.02)
    assert not is_fast_norm()


def test_pytorch_steps_adamw_with_foreach_kernels_on_a_gpu_and_one_tensor_at_a_time_on_the_cpu() -> None:
    """The rule, from torch/optim/optimizer.py: with `foreach` unset, AdamW takes the foreach kernels when every
    parameter is a plain tensor on a device that has them (CUDA, not the CPU), the one-tensor loop otherwise."""
    from torch.optim.optimizer import _default_to_fused_or_foreach, _get_foreach_kernels_supported_devices

    assert "cuda" in _get_foreach_kernels_supported_devices() and "cpu" not in _get_foreach_kernels_supported_devices()
    assert _default_to_fused_or_foreach([torch.zeros(2)], differentiable=False) == (False, False)
    model = nn.Linear(4, 4)
    assert trace.steady_optimizer(model, 1, autocast_policy.CUDA).defaults["foreach"] is True
    assert trace.steady_optimizer(model, 1, autocast_policy.CPU).defaults["foreach"] is None  # PyTorch's choice


def test_the_traced_gpu_step_holds_adamws_foreach_temporaries() -> None:
    """Where the optimizer step sets the peak (ten equal convolutions, one image, no autocast), CUDA's rules trace
    what foreach holds: the square roots of every second moment at once (one parameter-sized list), where the
    one-tensor loop holds two of one tensor's (its square root and that over the bias correction)."""

    def build() -> nn.Module:
        convs = [nn.Conv2d(64, 64, 3, padding=1) for _ in range(10)]
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
        return nn.Sequential(nn.Conv2d(1, 64, 3, stride=4), *convs, *head)

    sizes = [p.numel() * 4 / MIB for p in build().parameters()]
    on_cpu = trace.trace_step(
        trace.TracedStep(build=build, micro=1, accum=1, num_classes=10, dtype=None), policy=autocast_policy.CPU
    )
    on_gpu = trace.trace_step(
        trace.TracedStep(build=build, micro=1, accum=1, num_classes=10, dtype=None), policy=autocast_policy.CUDA
    )
    assert on_cpu["activations_mib"] == on_gpu["activations_mib"] == 0  # the step's peak, after backward
    assert on_gpu["peak_mib"] - on_cpu["peak_mib"] == pytest.approx(sum(sizes) - 2 * max(sizes), rel=1e-3)


def test_an_older_torchs_cuda_autocast_ran_gelu_in_float32_and_a_newer_or_unknown_one_is_refused() -> None:
    """torch 1.6 to 1.9 listed gelu among CUDA autocast's float32 ops; 1.10 on do not (FP32_UNTIL)."""
    x = torch.randn(4, 4, dtype=torch.float16)
    for version, dtype in (("1.7.1", torch.float32), ("1.9", torch.float32), ("1.10.0", torch.float16)):
        with autocast_policy.cuda_policy(version), torch.autocast("cpu", dtype=torch.float16):
            assert F.gelu(x).dtype == dtype, version
            assert F.layer_norm(x, (4,)).dtype == torch.float32  # the pinned lists still hold
    with autocast_policy.cuda_policy(), torch.autocast("cpu", dtype=torch.float16):
        assert F.gelu(x).dtype == torch.float16
    for bad in ("2.99", "latest"):
        with pytest.raises(BadInput, match=bad):
            autocast_policy.fp32_before(bad)


def test_before_torch_1_11_softmax_kept_its_float16_input_for_backward_and_its_gradient_is_unchanged() -> None:
    """_softmax_backward_data took `self` until pytorch/pytorch#65242: the input stayed live until backward."""
    x = torch.randn(4, 5, dtype=torch.float16, requires_grad=True)
    grads = {}
    for version in ("1.7.1", "1.11.0"):
        with autocast_policy.cuda_policy(version), torch.autocast("cpu", dtype=torch.float16):
            y = F.softmax(x, -1)
        assert y.dtype == torch.float32
        kept = any(t is x for t in getattr(y.grad_fn, "saved_tensors", ()))
        assert kept == (version == "1.7.1"), version
        (grads[version],) = torch.autograd.grad((y * torch.arange(5.0)).sum(), x)
    assert torch.equal(grads["1.7.1"], grads["1.11.0"]) and grads["1.7.1"].dtype == torch.float16
    older = (
        "gelu in float32; softmax and log_softmax keeping their input for backward; rms_norm in its input's dtype "
        "(not yet on the float32 list); hardtanh_ keeping its result, not a clone of its input"
    )
    assert autocast_policy.older_rules("1.7.1") == older
    assert autocast_policy.older_rules("2.11.0") == "rms_norm in its input's dtype (not yet on the float32 list)"
    assert autocast_policy.older_rules("2.14.1") == ""


def test_before_torch_2_12_cuda_autocast_left_rms_norm_in_its_inputs_dtype() -> None:
    """rms_norm joined AT_FORALL_FP32 in 2.12 (pytorch/pytorch#188955)."""
    x, weight = torch.randn(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16)
    for version, dtype in (("2.11.0", torch.float16), ("2.12.0", torch.float32), ("2.14.1", torch.float32)):
        with autocast_policy.cuda_policy(version), torch.autocast("cpu", dtype=torch.float16):
            assert F.rms_norm(x, (8,), weight).dtype == dtype, version


def relu6_step(version: str) -> dict[str, Any]:
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU6(inplace=True), nn.Conv2d(64, 64, 3, padding=1),
                             nn.ReLU6(inplace=True), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))  # fmt: skip

    s = trace.TracedStep(build=build, micro=64, accum=1, num_classes=10, dtype=torch.float16, input=(3, 8, 8),
                         arrives="float32", torch_version=version)  # fmt: skip
    return trace.trace_step(s, autocast_policy.CUDA)


def test_before_torch_1_10_relu6_in_place_kept_its_result_not_a_clone_and_its_gradient_is_the_same() -> None:
    """hardtanh_'s derivative read its result until PR #62329 (1.10): no clone of the input (pytorch#95432)."""
    activation_mib = 64 * 64 * 8 * 8 * 2 / MIB  # one float16 conv output
    saved = relu6_step("2.14.1")["activations_mib"] - relu6_step("1.9.0")["activations_mib"]
    assert saved == pytest.approx(2 * activation_mib, rel=0.1)  # one clone per ReLU6
    x = torch.randn(6, 6) * 8
    grads = {}
    for version in ("1.9.0", "2.14.1"):
        leaf = x.clone().requires_grad_()
        with autocast_policy.cuda_policy(version):
            y = F.relu6(leaf * 1, inplace=True)
        (grads[version],) = torch.autograd.grad((y * torch.arange(6.0)).sum(), leaf)
    assert torch.equal(grads["1.9.0"], grads["2.14.1"])
