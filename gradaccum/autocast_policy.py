"""CUDA's autocast policy on CPU tensors: what a GPU's float16 step holds, traced on a machine without one.

CPU and CUDA autocast are different policies. CUDA runs group_norm and layer_norm in float32 and gives
softmax, log_softmax and sum a float32 output; CPU autocast lists none of them, so a GroupNorm model
traced under `torch.autocast("cpu")` keeps float16 tensors that a GPU keeps in float32. Fake CUDA tensors
cannot run backward without a driver, so `cuda_policy()` re-registers the AutocastCPU kernels, inside
this process only and only while it is open, to cast as CUDA's do: the way torch.library.register_autocast
gives a custom op its policy.

The lists are PyTorch's own, copied from aten/src/ATen/autocast_mode.h of the installed torch (the
AT_FORALL_* macros that autocast_mode.cpp registers on the CUDA `Autocast` key). tests/test_autocast_policy.py
holds them against that header and against the dispatcher's AutocastCUDA kernels. On another torch whose CUDA
registrations differ (a GPU machine's older torch), `cuda_policy()` still traces a model that never calls a
differing op, and refuses one that does, naming the op: no step is traced with a stale policy. An op CUDA does
not list falls through, as on a GPU.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.choices import PINNED_TORCH  # the torch these lists were read from
from gradaccum.refusal import BadInput

CPU, CUDA = "cpu", "cuda"  # the policies a trace row names
NATIVE_CUDA = "cuda_native"  # CUDA's own autocast on fake CUDA tensors: only where a driver is (the device check)


def of_device(device: str) -> str:
    """The autocast policy a device trains under: its own ("cpu" or "cuda")."""
    return {"cpu": CPU, "cuda": CUDA}[device]


# AT_FORALL_LOWER_PRECISION_FP: every floating input cast to the autocast dtype (float16 for the study).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
# AT_FORALL_FP32: every floating input cast to float32.
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
# AT_FORALL_FP32_SET_OPT_DTYPE: a float32 output (dtype=float32 unless given) when the first input is floating.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype): the overload with a dtype, given float32.
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# AT_FORALL_PROMOTE: the widest floating input's dtype for all.
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)  # fmt: skip
BANNED = ("binary_cross_entropy",)  # autocast_mode.cpp: binary_cross_entropy_banned
# Registered on AutocastCUDA outside those lists: cuDNN's own ops take CUDA tensors only, so a CPU trace never
# reaches them; linalg_matrix_sqrth's policy is not in the header, so a model that calls it is refused.
CUDA_ONLY = ("_cudnn_rnn", "cudnn_convolution", "cudnn_convolution_transpose")
UNKNOWN = ("linalg_matrix_sqrth",)
# Ops an older torch's CUDA autocast cast to float32 that the lists above do not, and the release that stopped:
# torch 1.6 to 1.9's autocast_mode.cpp has `KERNEL(ADD_NS(gelu), "gelu", ..., fp32)`; pytorch/pytorch#59639
# (June 2021, after 1.9 had branched) took it out. Only these differences are modelled for an older torch.
FP32_UNTIL = {"gelu": "1.10"}
# Ops whose backward an older torch fed their input as well as their output, so autograd kept the input until
# then: _softmax_backward_data took `self` (pytorch/pytorch#49600) until #65242 (September 2021, after 1.10 had
# branched) passed its dtype instead. On CUDA, float16 in and float32 out, the input kept was the float16 one.
SAVES_INPUT_UNTIL = {"softmax.int": "1.11", "log_softmax.int": "1.11"}
BACKWARD = {"softmax.int": "_softmax_backward_data", "log_softmax.int": "_log_softmax_backward_data"}
# Ops CUDA's fp32 list took in at a release: rms_norm from 2.12 (pytorch/pytorch#188955); before, not listed, it
# ran in its input's dtype, as an op CUDA does not list falls through.
FP32_FROM = {"rms_norm": "2.12"}
# In-place activations whose derivative read their result until a release, so autograd kept the result alone; from
# then it reads the input, and autograd clones the input before the op writes over it: hardtanh_ (ReLU6(inplace=True))
# from 1.10 (PR #62329 switched its derivative to `self`; pytorch/pytorch#95432).
RESULT_BACKWARD_UNTIL = {"hardtanh_": "1.10"}

POLICIES = {
    **dict.fromkeys(LOWER_PRECISION_FP, "lower_precision_fp"),
    **dict.fromkeys(FP32, "fp32"),
    **dict.fromkeys(FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(PROMOTE, "promote"),
    **dict.fromkeys(BANNED, "banned"),
    **dict.fromkeys(CUDA_ONLY + UNKNOWN, "unknown"),
}


class PolicyMismatch(BadInput, RuntimeError):
    """The traced model calls an op whose CUDA autocast registration on the installed torch differs from the lists
    here: its policy on this torch is not known, so no figure is given for it."""


def registered(key: str) -> set[str]:
    """The aten ops (name.overload) with a kernel on dispatch key `key` in this process."""
    aten = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    return {n.removeprefix("aten::") for n in aten if torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


@dataclass(frozen=True)
class Difference:
    """The installed torch's CUDA autocast kernels against the lists here: ops it registers that they lack (`new`),
    and ops they list that it does not register (`gone`: torch 2.11 has no `rms_norm`, added to CUDA's list in 2.12)."""

    torch: str
    new: tuple[str, ...]
    gone: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.new or self.gone)

    def __str__(self) -> str:
        parts = [f"{what} {', '.join(ops)}" for what, ops in (("lacks", self.gone), ("adds", self.new)) if ops]
        return f"torch {self.torch}'s CUDA autocast lists differ from torch {PINNED_TORCH}'s: it {'; '.join(parts)}"


def difference() -> Difference:
    cuda = registered("AutocastCUDA")
    return Difference(torch.__version__, tuple(sorted(cuda - set(POLICIES))), tuple(sorted(set(POLICIES) - cuda)))


def _refuse_kernel(name: str, diff: Difference) -> Any:
    """An op whose CUDA policy differs on this torch: a trace that reaches it stops, naming it, rather than cast
    it by a policy that this torch's GPU would not follow."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise PolicyMismatch(
            f"the traced model calls aten::{name}, and {diff}; its cast on this torch's GPU is unknown, so this "
            f"trace cannot stand for it: trace on torch {PINNED_TORCH} (the lists' own), or update the lists from "
            "this torch's aten/src/ATen/autocast_mode.h"
        )

    return kernel


def _eligible(value: Any) -> bool:
    """is_eligible in autocast_mode.h: a defined floating tensor on the device, not float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """cached_cast: an eligible tensor (or each in a list) to `dtype`; anything else as it is. No cache: the
    cast copy of a weight is the tensor the op saves, so memory is the same."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value


def _promote_type(args: tuple, kwargs: dict, lower: torch.dtype) -> torch.dtype:
    """promote_type: float32 if any eligible input is float32, else the lower precision; float64 ignored."""
    for t in _tensors((*args, *kwargs.values())):
        if _eligible(t) and t.dtype not in (lower, torch.float32):
            raise RuntimeError(f"Unexpected floating ScalarType {t.dtype} in at::autocast::prioritize")
        if _eligible(t) and t.dtype == torch.float32:
            return torch.float32
    return lower


class _KeepsInput(torch.autograd.Function):
    """softmax or log_softmax as an older torch's autograd saw it: holding the input as well as the output until
    its backward ran (SAVES_INPUT_UNTIL); the gradient is the one the current kernel computes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
        out = _overload(name)(x, dim, dtype=dtype)
        ctx.save_for_backward(x, out)
        ctx.name, ctx.dim = name, dim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, out = ctx.saved_tensors  # the CPU kernel has no float32-to-float16 backward: it casts after, as the
        grad_x = getattr(torch.ops.aten, BACKWARD[ctx.name])(grad, out, ctx.dim, out.dtype)  # emulation does anyway
        return grad_x.to(x.dtype), None, None, None


def _kernel(name: str, policy: str, keeps_input: bool = False) -> Any:
    """The AutocastCPU kernel that casts as CUDA's `policy` does, then runs the op with autocast off;
    `keeps_input`: autograd keeps its input until backward, as an older torch's did (softmax's)."""
    op = _overload(name)
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype(CPU)  # the study's dtype, as torch.autocast("cpu", dtype=...) set it
        with torch._C._ExcludeDispatchKeyGuard(no_autocast):
            if policy == "lower_precision_fp":
                return op(*_cast(args, lower), **{k: _cast(v, lower) for k, v in kwargs.items()})
            if policy == "fp32":
                return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == "promote":
                to = _promote_type(args, kwargs, lower)
                return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})
            if policy == "fp32_set_opt_dtype":
                given = args[2] if len(args) > 2 else kwargs.get("dtype")
                if keeps_input and _eligible(args[0]) and given is None:
                    return _KeepsInput.apply(args[0], name, args[1], torch.float32)
                if _eligible(args[0]):
                    return op(*args, **_with_dtype(op, args, kwargs, torch.float32))
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype":
                out = torch.float32 if _eligible(args[0]) else args[0].dtype
                return _overload(FP32_APPEND_DTYPE[name])(*args, **kwargs, dtype=out)
            if policy == "banned":
                raise RuntimeError(f"aten::{name} is unsafe to autocast (CUDA autocast refuses it; autocast_mode.cpp)")
            raise PolicyMismatch(f"aten::{name}: CUDA registers an autocast kernel whose policy is not in its lists")

    return kernel


def _with_dtype(op: torch._ops.OpOverload, args: tuple, kwargs: dict, dtype: torch.dtype) -> dict:
    """set_opt_dtype: the op's `dtype` argument set to `dtype` unless the caller gave one."""
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    if index < len(args):
        if args[index] is not None:
            return kwargs
        raise NotImplementedError(f"{op}: dtype=None passed positionally")  # never seen: dtype is keyword-only
    return kwargs if kwargs.get("dtype") is not None else kwargs | {"dtype": dtype}


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def fp32_before(version: str) -> tuple[str, ...]:
    """The ops that torch `version`'s CUDA autocast casts to float32 beyond the lists here (FP32_UNTIL)."""
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        raise BadInput(f"autocast of torch {version!r}: not a release such as 1.7.1")
    if release(version) > release(PINNED_TORCH):
        raise BadInput(f"autocast of torch {version}: only torch {PINNED_TORCH}'s lists and older ones are known")
    return tuple(op for op, until in FP32_UNTIL.items() if release(version) < release(until))


def keeps_input(version: str) -> tuple[str, ...]:
    """The ops whose input torch `version`'s autograd kept until their backward (SAVES_INPUT_UNTIL)."""
    fp32_before(version)  # the same check of the version
    return tuple(op for op, until in SAVES_INPUT_UNTIL.items() if release(version) < release(until))


def not_yet_fp32(version: str) -> tuple[str, ...]:
    """The ops on the lists here that torch `version`'s CUDA autocast did not yet cast to float32 (FP32_FROM)."""
    fp32_before(version)
    return tuple(op for op, since in FP32_FROM.items() if release(version) < release(since))


def saves_result(version: str) -> tuple[str, ...]:
    """The in-place ops whose backward read their result on torch `version`, so no clone was kept."""
    fp32_before(version)
    return tuple(op for op, until in RESULT_BACKWARD_UNTIL.items() if release(version) < release(until))


def older_rules(version: str) -> str:
    """How torch `version`'s CUDA step differs from the pinned torch's in what it keeps, as far as modelled (each
    rule with its source above); "" for none."""
    fp32, kept, unlisted, result = (
        fp32_before(version),
        keeps_input(version),
        not_yet_fp32(version),
        saves_result(version),
    )
    parts = [f"{', '.join(fp32)} in float32"] if fp32 else []
    parts += [f"{' and '.join(op.partition('.')[0] for op in kept)} keeping their input for backward"] if kept else []
    parts += [f"{', '.join(unlisted)} in its input's dtype (not yet on the float32 list)"] if unlisted else []
    parts += [f"{', '.join(result)} keeping its result, not a clone of its input"] if result else []
    return "; ".join(parts)


class _InPlaceFromResult(torch.autograd.Function):
    """hardtanh_ as torch before 1.10 differentiated it: from its result (kept, marked dirty), no clone of the input;
    the gradient is the same (the result is inside the bounds exactly where the input was)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: float, high: float) -> torch.Tensor:
        below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
        with torch._C._ExcludeDispatchKeyGuard(below):
            torch.ops.aten.hardtanh_.default(x, low, high)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        ctx.bounds = (low, high)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (result,) = ctx.saved_tensors
        low, high = ctx.bounds
        return grad * ((result > low) & (result < high)), None, None


def _result_kernel(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):
        below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
        with torch._C._ExcludeDispatchKeyGuard(below):
            return torch.ops.aten.hardtanh_.default(x, min_val, max_val)
    return _InPlaceFromResult.apply(x, min_val, max_val)


def release(version: str) -> tuple[int, ...]:
    """A torch release as numbers, to compare: "1.10" after "1.9"."""
    return tuple(int(part) for part in version.split("."))


@contextlib.contextmanager
def cuda_policy(version: str = PINNED_TORCH) -> Iterator[Difference]:
    """Inside: CPU autocast casts as CUDA autocast does, op by op. Outside again: the CPU's own policy.
    `version`: an older torch's CUDA autocast, as far as FP32_UNTIL knows how it differed.

    Every op CUDA lists gets a kernel casting as CUDA's; every op only the CPU lists (cat, stack,
    cross_entropy_loss, the 3-d pools, ...) falls through to its decomposition, as it does on a GPU. On a torch
    whose CUDA lists differ from these, each differing op refuses when called, so a model that never calls one
    traces as before; what it yields names the difference, for the trace's record.
    """
    diff, unlisted = difference(), not_yet_fp32(version)
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - confined to this context
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            for name, policy in POLICIES.items():
                if name not in CUDA_ONLY and name not in diff.gone and name not in unlisted:
                    lib.impl(name, _kernel(name, policy, name in keeps_input(version)), "AutocastCPU")
            older = fp32_before(version)
            for name in older:
                lib.impl(name, _kernel(name, "fp32"), "AutocastCPU")
            for name in unlisted:
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            for name in saves_result(version):
                lib.impl(name, _result_kernel, "AutogradCPU")
            for name in registered("AutocastCPU") - set(POLICIES) - set(diff.new) - set(older):
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            for name in (*diff.gone, *diff.new):
                with contextlib.suppress(AttributeError, RuntimeError):  # an op this torch does not have at all
                    lib.impl(name, _refuse_kernel(name, diff), "AutocastCPU")
        yield diff
    finally:
        lib._destroy()  # the CPU's own kernels are back: the CPU-scale trace is checked against them
