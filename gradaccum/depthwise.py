"""Depthwise convolution on small maps as one batched matrix product per channel (CPU only).

On 28x28 digits efficientnet_b0's later stages run 3x3 and 5x5 depthwise kernels on 7x7 down to
1x1 maps, and oneDNN's depthwise kernels are slow there: on a 2-core CPU they took over half of a
training step, mostly multiplying taps that only ever read the zero padding. On a map of P <= 64
pixels each channel's convolution is a P_out x P matrix built from its k x k weights (a tap that
reads padding is a zero entry), so a whole layer is one bmm. Same sums, same parameters and the
same saved tensors (the input and the weight), so training keeps the same memory; 1.9x faster at
micro-batch 64 and 2.6x at 256 on the 2-core reference machine (benchmarks/convolutions.py).
Under autocast both operands are cast to its dtype first, as autocast casts conv2d's, so the step
saves the same bfloat16 copies; there the matrices made the bfloat16 variant's training 2.6-3.1x
faster than oneDNN's bfloat16 depthwise kernels (benchmarks/convolutions.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MAX_PIXELS = 64  # up to 8x8 maps; at 14x14 the matrices cost more than oneDNN's kernel (measured)


def tap_index(
    size: tuple[int, int],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    out: tuple[int, int],
) -> torch.Tensor:
    """(output pixels, input pixels): the kernel tap (row * kw + col) linking the two; kh * kw where none does."""
    (h, w), (kh, kw), (ho, wo) = size, kernel, out
    index = torch.full((ho * wo, h * w), kh * kw, dtype=torch.long)
    for oy in range(ho):
        for ox in range(wo):
            for a in range(kh):
                for b in range(kw):
                    iy = oy * stride[0] + a * dilation[0] - padding[0]
                    ix = ox * stride[1] + b * dilation[1] - padding[1]
                    if 0 <= iy < h and 0 <= ix < w:
                        index[oy * wo + ox, iy * w + ix] = a * kw + b
    return index


def tap_matrices(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(channels, output pixels, input pixels): each channel's convolution as a matrix."""
    flat = weight.reshape(len(weight), -1)
    return torch.cat([flat, flat.new_zeros(len(weight), 1)], 1)[:, index]  # the extra column: no tap, a zero


class DepthwiseAsMatmul(torch.autograd.Function):
    """Forward and backward as bmm over channels; saves only the input and the weight, as F.conv2d does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, out: tuple[int, int]):
        ctx.save_for_backward(x, weight, index)
        n, c = x.shape[:2]
        y = torch.bmm(x.reshape(n, c, -1).transpose(0, 1), tap_matrices(weight, index).transpose(1, 2))
        return y.transpose(0, 1).reshape(n, c, *out)  # (channels, n, pixels) back to (n, channels, h, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight, index = ctx.saved_tensors
        n, c = x.shape[:2]
        g = grad.reshape(n, c, -1).transpose(0, 1)  # (channels, n, output pixels)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(g, tap_matrices(weight, index)).transpose(0, 1).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            per_entry = torch.bmm(g.transpose(1, 2), x.reshape(n, c, -1).transpose(0, 1)).reshape(c, -1)
            acc = torch.promote_types(weight.dtype, torch.float32)  # a bfloat16 weight's taps summed in float32
            per_tap = per_entry.new_zeros(c, weight[0].numel() + 1, dtype=acc).scatter_add_(
                1, index.reshape(1, -1).expand(c, -1), per_entry.to(acc)
            )
            grad_w = per_tap[:, :-1].to(weight.dtype).reshape(weight.shape)  # the last column: entries of no tap
        return grad_x, grad_w, None, None


class SmallMapDepthwiseConv2d(nn.Conv2d):
    """nn.Conv2d that runs as DepthwiseAsMatmul when it is depthwise and its input map is small."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h * w > MAX_PIXELS:
            return super().forward(x)
        out = tuple(
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip((h, w), self.kernel_size, self.stride, self.padding, self.dilation, strict=True)
        )
        cache = self.__dict__.setdefault("_tap_index", {})  # not a buffer: no state_dict entry, no device move
        if (h, w) not in cache:
            cache[h, w] = tap_index((h, w), self.kernel_size, self.stride, self.padding, self.dilation, out)
        if torch.is_autocast_enabled(x.device.type):  # as autocast runs conv2d: both operands in its dtype,
            dtype = torch.get_autocast_dtype(x.device.type)  # which is what the step saves for backward
            with torch.autocast(x.device.type, enabled=False):
                return DepthwiseAsMatmul.apply(x.to(dtype), self.weight.to(dtype), cache[h, w], out)
        return DepthwiseAsMatmul.apply(x, self.weight, cache[h, w], out)


def is_depthwise(m: nn.Module) -> bool:
    return (
        type(m) is nn.Conv2d
        and m.groups == m.in_channels == m.out_channels
        and m.bias is None
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    )


def use_matmul_depthwise(model: nn.Module) -> nn.Module:
    """Every depthwise nn.Conv2d becomes a SmallMapDepthwiseConv2d, in place (same parameters)."""
    for m in model.modules():
        if is_depthwise(m):
            m.__class__ = SmallMapDepthwiseConv2d
    return model
