"""scaled_dot_product_attention and dropout as CUDA runs them (gradaccum/attention.py), pinned rule by rule to
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, derivatives.yaml and Dropout.cpp."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import allocator, attention, autocast_policy, trace
from gradaccum.attention import CUDNN, EFFICIENT, FLASH, MATH, Call, CudaKernels, select

H100, A100, A10, V100 = (allocator.GPUS[g] for g in ("h100", "a100-40gb", "a10", "v100-16gb"))
BERT = Call(torch.float16, 8, 16, 16, 512, 512, 64, 64, mask=False, dropout=0.1, causal=False)


@pytest.mark.parametrize(
    ("call", "gpu", "kernel", "passed_over"),
    [
        (replace(BERT, dropout=0.0), H100, CUDNN, ()),  # cuDNN first on sm90 (check_prefer_cudnn_attention)
        (BERT, H100, FLASH, ("cudnn: dropout 0.1",)),  # check_cudnn_dropout: a multiple of 1/16 only
        (replace(BERT, dropout=0.125), H100, CUDNN, ()),
        (replace(BERT, mask=True), H100, EFFICIENT, ("cudnn: dropout", "flash: flash attention takes no attention")),
        (replace(BERT, dropout=0.0), A100, FLASH, ()),  # sm80: flash, efficient, math (cuDNN after math)
        (replace(BERT, dtype=torch.float32), A100, EFFICIENT, ("flash: flash attention takes float16",)),
        (BERT, V100, EFFICIENT, ("flash: flash attention needs sm80",)),
        (replace(BERT, dtype=torch.bfloat16), V100, MATH, ("flash:", "efficient: memory-efficient attention takes no")),
        (replace(BERT, head_dim=256, v_dim=256), A10, EFFICIENT, ("flash: flash attention cannot train",)),
        (replace(BERT, head_dim=256, v_dim=256, dropout=0.0), A10, FLASH, ()),  # above 224 without dropout: fine
        (replace(BERT, causal=True, q_len=1, dropout=0.0), A100, EFFICIENT, ("flash: flash attention's is_causal",)),
        (replace(BERT, head_dim=60, v_dim=60, dtype=torch.float32), A100, EFFICIENT, ("flash: flash attention takes",)),
        (replace(BERT, head_dim=60, v_dim=60, mask=True), A100, MATH, ("flash:", "efficient: ... divisible by 8")),
        (replace(BERT, heads=16, kv_heads=4, dropout=0.0), H100, CUDNN, ()),  # grouped keys: all three take them
    ],
)
def test_cuda_picks_the_kernel_its_rules_say(call: Call, gpu: allocator.Gpu, kernel: str, passed_over: tuple) -> None:
    got, why = select(call, gpu)
    assert got == kernel
    assert len(why) == len(passed_over)
    for reason, expected in zip(why, passed_over, strict=True):
        head, _, tail = expected.partition("...")
        assert reason.startswith(head.strip()) and tail.strip() in reason


def test_the_fused_kernels_keep_a_float32_log_sum_exp_of_their_own_shape() -> None:
    """flash [B, H, Lq]; memory-efficient padded to 32 queries (kAlignLSE); cuDNN's softmax statistics [.., 1]."""
    assert attention.lse_shape(FLASH, 2, 3, 100) == (2, 3, 100)
    assert attention.lse_shape(EFFICIENT, 2, 3, 100) == (2, 3, 128)
    assert attention.lse_shape(CUDNN, 2, 3, 100) == (2, 3, 100, 1)


def saved_bytes(fn: object, *inputs: torch.Tensor) -> int:
    """The bytes of the distinct storages autograd keeps for backward of fn(*inputs) (real CPU tensors)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)  # type: ignore[operator]
    return sum(seen.values())


@pytest.mark.parametrize("mask", [None, "bool", "causal"])
def test_the_math_path_keeps_what_pytorchs_own_math_kernel_keeps(mask: str | None) -> None:
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    m = torch.ones(16, 16, dtype=torch.bool).tril() if mask == "bool" else None
    causal = mask == "causal"
    ours = saved_bytes(lambda *t: attention.math_attention(*t, m, 0.0, causal, None, False), q, k, v)
    theirs = saved_bytes(lambda *t: torch.ops.aten._scaled_dot_product_attention_math(*t, m, 0.0, causal)[0], q, k, v)
    assert ours == theirs
    out = attention.math_attention(q, k, v, m, 0.0, causal, None, False)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal), atol=1e-5)


def test_a_cuda_dropout_keeps_a_bool_mask_where_the_cpus_keeps_a_float_noise() -> None:
    x = torch.randn(64, 64, dtype=torch.float16, requires_grad=True)
    cpu = saved_bytes(lambda t: F.dropout(t, 0.1) * 1, x)
    with CudaKernels(H100):
        cuda = saved_bytes(lambda t: F.dropout(t, 0.1) * 1, x)
        assert F.dropout(x, 0.1, training=False) is x
    assert (cpu, cuda) == (64 * 64 * 2, 64 * 64)  # float16 noise against a one-byte mask


class Attend(nn.Module):
    def __init__(self, mask: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 3 * 64)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.shape[0], 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        m = torch.ones(128, 128, dtype=torch.bool) if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m).mean((1, 2))


def step(gpu: allocator.Gpu, amp: torch.dtype | None = torch.float16) -> dict:
    s = trace.TracedStep(
        build=Attend, micro=32, accum=1, num_classes=16, dtype=amp, input=(1, 128, 64), arrives="float32"
    )
    return trace.trace_step(s, autocast_policy.CUDA, gpu)


def test_a_traced_step_names_the_kernel_and_only_the_math_path_keeps_the_attention_matrix() -> None:
    fused, math = step(H100), step(V100, torch.bfloat16)  # bfloat16 on sm70: neither fused kernel takes it
    assert fused["attention"]["kernels"] == {CUDNN: 1} and math["attention"]["kernels"] == {MATH: 1}
    matrix_mib = 32 * 4 * 128 * 128 * 4 / 2**20  # B x H x L x L float32 softmax, kept for backward
    assert fused["activations_mib"] < matrix_mib < math["activations_mib"]  # at the peak (backward's start)
    assert "attention" not in trace.trace_step(replace_step_policy(), autocast_policy.CPU)


def replace_step_policy() -> trace.TracedStep:
    return trace.TracedStep(build=Attend, micro=2, accum=1, num_classes=16, dtype=None, input=(1, 128, 64),
                            arrives="float32")  # fmt: skip
