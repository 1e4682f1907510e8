"""scaled_dot_product_attention and dropout as a CUDA GPU runs them, traced on fake CPU tensors.

On CUDA, `F.scaled_dot_product_attention` picks one of four kernels by the GPU, the dtype, the shapes, the mask and
the dropout (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `select_sdp_backend`), and each keeps different
tensors for backward (tools/autograd/derivatives.yaml): the fused ones keep the output and a float32 log-sum-exp,
never the attention matrix. On fake CPU tensors the CPU's own choice runs instead (sdp_utils_cpp.cpp: flash without
dropout, else the math path, which keeps the matrix in float32), so a traced BERT step with dropout would hold
attention matrices a GPU never makes. `CudaKernels` takes each call (cast as CUDA's autocast casts it:
scaled_dot_product_attention is on AT_FORALL_LOWER_PRECISION_FP), selects the kernel by CUDA's rules (`select`),
and runs a stand-in that allocates what that kernel allocates and saves what it saves. The math path is PyTorch's
own decomposition (`_scaled_dot_product_attention_math`, the same code on every device), run with autocast off as
the CUDA kernel runs it.

Dropout differs too (aten/src/ATen/native/Dropout.cpp): on a CUDA tensor `dropout` runs the fused `native_dropout`,
which keeps a bool mask for backward (one byte an element); on a CPU tensor it multiplies by a noise tensor of the
input's dtype, which autograd keeps (two or four bytes). In place (`dropout_`) both take the noise path. Under
`CudaKernels` a training dropout out of place runs native_dropout, as on CUDA, also inside the math attention.
tests/test_attention.py pins each rule.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.allocator import Gpu

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
# sdp_utils.cpp check_prefer_cudnn_attention: on the CUDA 13 wheels, with cuDNN newer than 9.15, cuDNN's kernel
# comes first on sm90 and sm100 (H100, H200, B200); elsewhere at::Context's default order, in which cuDNN comes
# after math and so is never taken.
CUDNN_FIRST = (CUDNN, FLASH, EFFICIENT, MATH)
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)
LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    """What the kernel selection reads of one call (sdp_params)."""

    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    v_dim: int
    mask: bool
    dropout: float
    causal: bool
    last_dim_contiguous: bool = True


def order(gpu: Gpu) -> tuple[str, ...]:
    """priority_order: cuDNN first on sm90 and sm10x (the CUDA 13 build), else flash, efficient, math."""
    return CUDNN_FIRST if gpu.sm[0] in (9, 10) else DEFAULT_ORDER


def why_not(kernel: str, c: Call, gpu: Gpu) -> str | None:
    """The first of the kernel's constraints (can_use_*_attention, dense inputs) that the call fails; None: it runs."""
    sm = gpu.sm
    if kernel == MATH:
        return None
    if not c.last_dim_contiguous:
        return "the last dimension is not contiguous"
    if c.kv_heads != c.heads and c.heads % c.kv_heads:
        return "the query's heads are not a multiple of the key's"
    if kernel == CUDNN:
        if c.dtype not in LOW:
            return f"cuDNN attention takes float16 or bfloat16, not {c.dtype}"
        if c.dropout * 16 != math.floor(c.dropout * 16):  # check_cudnn_dropout
            return f"dropout {c.dropout} is not a multiple of 1/16 (cuDNN's resolution)"
        if not 8 * 10 <= sm[0] * 10 + sm[1] <= 121:
            return "cuDNN attention needs sm80 to sm121"
        if c.batch > 65535 or c.heads > 65535:
            return "cuDNN attention takes at most 65535 sequences and heads"
        limit = 256 if sm[0] in (9, 10) else 128  # check_cudnn_tensor_shapes, with a cuDNN newer than 9.22
        if c.head_dim > limit or c.v_dim > limit or c.head_dim % 8 or c.v_dim % 8:
            return f"cuDNN attention needs head dimensions of at most {limit}, multiples of 8"
        if sm[0] in (9, 10) and not (
            (c.head_dim <= 128 and c.v_dim <= 128) or (c.head_dim, c.v_dim) in ((192, 128), (256, 256))
        ):  # check_cudnn_d256_bprop_head_dim
            return "cuDNN attention has no backward for these head dimensions"
        if c.k_len == 1:
            return "cuDNN attention takes no key sequence of length 1"
        return None
    if kernel == FLASH:
        if c.mask:
            return "flash attention takes no attention mask"
        if c.head_dim != c.v_dim or c.head_dim > 256:
            return "flash attention needs equal head dimensions of at most 256"
        if not (8, 0) <= sm <= (12, 1):
            return "flash attention needs sm80 to sm121"
        if sm in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)) and not (
            c.head_dim <= 192 or (c.dropout == 0 and c.head_dim > 224)
        ):
            return "flash attention cannot train head dimensions 193 to 224 (or to 256 with dropout) on sm86-89/120"
        if c.causal and c.q_len != c.k_len:
            return "flash attention's is_causal needs as many queries as keys"
        if c.dtype not in LOW:
            return f"flash attention takes float16 or bfloat16, not {c.dtype}"
        return None
    if kernel == EFFICIENT:
        if not (5, 0) <= sm <= (12, 1):
            return "memory-efficient attention needs sm50 to sm121"
        half = c.dtype in LOW
        tensor_cores = sm[0] >= 8 or (sm[0] >= 7 and half)  # use_tensor_cores
        align = max(4 if sm[0] >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
        if c.head_dim % align or c.v_dim % align:
            return f"memory-efficient attention needs head dimensions divisible by {align}"
        dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm[0] >= 8 else (torch.float16, torch.float32)
        if c.dtype not in dtypes:
            return f"memory-efficient attention takes no {c.dtype} on sm{sm[0]}{sm[1]}"
        return None
    raise ValueError(kernel)


def select(c: Call, gpu: Gpu) -> tuple[str, tuple[str, ...]]:
    """select_sdp_backend: the first kernel in the GPU's order whose constraints pass, and why each before it failed."""
    passed_over = []
    for kernel in order(gpu):
        reason = why_not(kernel, c, gpu)
        if reason is None:
            return kernel, tuple(passed_over)
        passed_over.append(f"{kernel}: {reason}")
    raise AssertionError("math always runs")


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def lse_shape(kernel: str, b: int, h: int, q_len: int) -> tuple[int, ...]:
    """The float32 log-sum-exp each fused kernel returns and autograd keeps: flash's [B, H, Lq]; the
    memory-efficient kernel's padded to 32 queries (kAlignLSE, mem_eff_attention/kernel_forward.h); cuDNN's
    softmax statistics [B, H, Lq, 1]."""
    if kernel == EFFICIENT:
        return (b, h, round_up(q_len, 32))
    if kernel == CUDNN:
        return (b, h, q_len, 1)
    return (b, h, q_len)


class _Fused(torch.autograd.Function):
    """A fused kernel's allocations: its output and log-sum-exp forward (kept with q, k, v for backward, and the mask
    where one was given), the three gradients backward, and for flash attention its float32 workspaces (flash_api.cpp
    mha_bwd: softmax_d [B, H, Lq rounded to 128] and dq_accum [B, Lq rounded, H, D rounded to 32], and for grouped
    keys dk and dv expanded to every head). Values are not computed: the tensors are fake."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, kernel: str) -> torch.Tensor:
        b, h, q_len, _ = q.shape
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(lse_shape(kernel, b, h, q_len), dtype=torch.float32)
        ctx.kernel = kernel
        saved = (q, k, v, out, lse) + ((mask,) if isinstance(mask, torch.Tensor) else ())
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, *_ = ctx.saved_tensors
        work = []
        if ctx.kernel == FLASH:
            b, h, q_len, d = q.shape
            work.append(q.new_empty((b, h, round_up(q_len, 128)), dtype=torch.float32))
            work.append(q.new_empty((b, round_up(q_len, 128), h, round_up(d, 32)), dtype=torch.float32))
            if k.shape[1] != h:
                work += [q.new_empty((b, h, k.shape[2], k.shape[3])), q.new_empty((b, h, v.shape[2], v.shape[3]))]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del work
        return dq, dk, dv, None, None


def cuda_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout.cpp's `dropout` on a CUDA tensor: native_dropout (a bool mask kept) where it is fused, else as is."""
    if not training or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * 0
    return torch.native_dropout(x, p, True)[0]


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout: float, causal: bool, scale: Any, gqa: bool
) -> torch.Tensor:
    """attention.cpp's _scaled_dot_product_attention_math, op for op, with CUDA's dropout: float16 and bfloat16
    inputs computed in float32, q and k each scaled by the root of the scale, the float32 softmax kept for backward,
    and the attention matrix cast back to the input's dtype (its second output, which sdpa drops at once)."""
    origin = q.dtype
    q, k, v = (t.float() if t.dtype in LOW else t for t in (q, k, v))
    factor = math.sqrt(scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    q = q * factor
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # convert_boolean_attn_mask
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask.logical_not(), -math.inf)
    if gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn = attn + mask
    attn = torch.softmax(attn, -1)
    attn = cuda_dropout(attn, dropout)
    out = torch.matmul(attn, v).to(origin)
    attn.to(origin)  # the second output, made and dropped
    return out


class CudaKernels:
    """While open, every scaled_dot_product_attention and dropout runs as CUDA's would on `gpu`: kernels registered
    in this process on the ops' CompositeImplicitAutograd key (their decomposition, above the fake tensors), so a
    checkpointed block's recomputation in backward takes them too. Under autocast the ops reach them already cast by
    the autocast kernel (scaled_dot_product_attention: lower_precision_fp), with autocast off inside, as on CUDA.
    `chosen` counts the attention kernels taken (recomputations included), `passed_over` says why those before
    them in the order were not."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.chosen: Counter[str] = Counter()
        self.passed_over: Counter[str] = Counter()
        self.lib: torch.library.Library | None = None

    def __enter__(self) -> CudaKernels:
        self.lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - confined to this context
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            self.lib.impl("scaled_dot_product_attention", self.attention, "CompositeImplicitAutograd")
            self.lib.impl("dropout", cuda_dropout, "CompositeImplicitAutograd")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.lib is not None
        self.lib._destroy()  # the CPU's own decompositions are back
        self.lib = None

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        call = Call(
            dtype=q.dtype,
            batch=q.shape[0],
            heads=q.shape[-3],
            kv_heads=k.shape[-3],
            q_len=q.shape[-2],
            k_len=k.shape[-2],
            head_dim=q.shape[-1],
            v_dim=v.shape[-1],
            mask=mask is not None,
            dropout=float(dropout_p),
            causal=bool(is_causal),
            last_dim_contiguous=all(t.stride(-1) == 1 for t in (q, k, v)),
        )
        kernel, passed_over = select(call, self.gpu)
        self.chosen[kernel] += 1
        self.passed_over.update(passed_over)
        if kernel == MATH:
            return math_attention(q, k, v, mask, call.dropout, call.causal, scale, enable_gqa)
        return _Fused.apply(q, k, v, mask, kernel)

    def summary(self) -> dict[str, Any]:
        """The kernels taken and the reasons the earlier ones were passed over, for the trace's row."""
        return {"kernels": dict(self.chosen), "passed_over": sorted(self.passed_over)}
