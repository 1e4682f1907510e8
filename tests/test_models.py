"""BatchNorm -> GroupNorm swap: nothing left behind, nothing lost, nothing downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.layers import GroupNormAct
from torch import nn

from gradaccum.accumulation import relative_difference
from gradaccum.depthwise import DepthwiseAsMatmul, SmallMapDepthwiseConv2d, tap_index, use_matmul_depthwise
from gradaccum.models import batchnorm_to_groupnorm, build_model, count_parameters
from gradaccum.params import Model

MODEL = Model(name="efficientnet_b0", in_chans=1, num_classes=10, group_norm_groups=1)
SEED = 99


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module]:
    return build_model(MODEL, "batch", SEED), build_model(MODEL, "group", SEED)


def test_no_batchnorm_left(models: tuple[nn.Module, nn.Module]) -> None:
    bn, gn = models
    assert sum(isinstance(m, nn.BatchNorm2d) for m in bn.modules()) == 49
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gn.modules())
    groups = [m for m in gn.modules() if isinstance(m, nn.GroupNorm)]
    assert len(groups) == 49 and {g.num_groups for g in groups} == {1}


def test_parameter_count_unchanged(models: tuple[nn.Module, nn.Module]) -> None:
    bn, gn = models
    assert count_parameters(bn) == count_parameters(gn) == 4_019_782  # timm's efficientnet_b0, 1 channel, 10 classes


def test_activations_fused_in_the_norm_are_kept(models: tuple[nn.Module, nn.Module]) -> None:
    bn, gn = models
    silus = [sum(isinstance(m, nn.SiLU) for m in model.modules()) for model in models]
    assert silus[0] == silus[1] > 30  # a plain nn.GroupNorm swap would lose the SiLU inside each BatchNormAct2d


def test_same_initial_weights(models: tuple[nn.Module, nn.Module]) -> None:
    bn, gn = models
    bn_params, gn_params = dict(bn.named_parameters()), dict(gn.named_parameters())
    assert bn_params.keys() == gn_params.keys()
    assert all(torch.equal(bn_params[k], gn_params[k]) for k in bn_params)


def test_plain_batchnorm_and_num_groups() -> None:
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    batchnorm_to_groupnorm(model, num_groups=4)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 4
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 8, 6, 6)


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_gradient_of_a_sample_depends_on_its_batch_only_with_batchnorm(
    models: tuple[nn.Module, nn.Module], norm: str
) -> None:
    """In train mode (as accumulation runs), the gradient of two samples' loss, alone or inside a batch of 8.

    GroupNorm normalizes each sample by itself: the same gradient. BatchNorm normalizes by the batch's
    statistics: another gradient, which is why the tutorial had to swap it for accumulation.
    """
    model = copy.deepcopy(models[norm == "group"]).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)

    def gradient(batch: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[:batch])[:2], y[:2]).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    diff = relative_difference(gradient(8), gradient(2))
    if norm == "group":
        assert diff < 1e-5
    else:
        assert diff > 1e-2


def test_the_tutorials_plain_swap_drops_the_fused_activations(models: tuple[nn.Module, nn.Module]) -> None:
    _, kept = models
    plain = build_model(MODEL, "group", SEED, swap="plain")

    def count(model: nn.Module, kinds: tuple[type, ...]) -> int:
        return sum(isinstance(m, kinds) for m in model.modules())

    def fused_acts(model: nn.Module) -> list[nn.Module]:
        return [m.act for m in model.modules() if isinstance(m, GroupNormAct)]

    assert len(fused_acts(kept)) - len(fused_acts(plain)) == 49  # one activation per norm layer, all gone
    assert count(kept, (nn.SiLU,)) - count(plain, (nn.SiLU,)) == 33  # 33 of them SiLU, 16 Identity
    assert sum(isinstance(a, nn.SiLU) for a in fused_acts(kept)) == 33
    assert count(plain, (nn.GroupNorm,)) == 49 and count_parameters(plain) == count_parameters(kept)
    x = torch.randn(2, 1, 28, 28)
    kept.eval(), plain.eval()
    with torch.no_grad():
        assert not torch.allclose(kept(x), plain(x), atol=1e-3)  # same weights, another function


def test_checkpointed_gradient_equals_the_plain_gradient() -> None:
    """Activation checkpointing recomputes, it does not approximate: same gradient (GroupNorm, float32)."""
    plain = build_model(MODEL, "group", SEED).train()
    ckpt = build_model(MODEL, "group", SEED, checkpointing=True).train()
    assert ckpt.grad_checkpointing and not plain.grad_checkpointing
    x, y = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 10
    grads = []
    for model in (plain, ckpt):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) <= 1e-5


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [
        (1, 5, 1, 2, 1),  # efficientnet_b0's last stages on 28x28 digits: only the centre tap reads the map
        (2, 5, 1, 2, 1),
        (2, 5, 2, 2, 1),  # strided
        (2, 3, 1, 1, 1),
        (4, 5, 2, 2, 1),
        (7, 3, 1, 1, 1),  # the largest map the matrices take
        (5, 4, 3, 3, 1),  # even kernel, uneven strides
        (1, 3, 1, 2, 2),  # dilated
    ],
)
def test_depthwise_as_matmul_is_the_same_convolution(size, kernel, stride, padding, dilation) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 6, kernel, stride, padding, dilation, groups=6, bias=False).double()
    matmul = use_matmul_depthwise(nn.Sequential(copy.deepcopy(conv)))[0]
    assert type(matmul) is SmallMapDepthwiseConv2d
    x = torch.randn(3, 6, size, size + 1, dtype=torch.float64, requires_grad=True)  # not square
    results = []
    for m in (conv, matmul):
        out = m(x)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        results.append((out, *torch.autograd.grad((out * weights).sum(), (x, m.weight))))
    for a, b in zip(*results, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x, w: DepthwiseAsMatmul.apply(x, w, *matmul_args(matmul, x)), (x, matmul.weight)
    )


def matmul_args(m: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    m(x)  # fills the module's cache of tap indices for this map size
    return m._tap_index[tuple(x.shape[-2:])], m(x).shape[-2:]


def test_tap_index_by_hand() -> None:
    # a 2x2 map, 3x3 kernel, padding 1: every output pixel reads all four input pixels, each through its own tap
    assert tap_index((2, 2), (3, 3), (1, 1), (1, 1), (1, 1), (2, 2)).tolist() == [
        [4, 5, 7, 8],
        [3, 4, 6, 7],
        [1, 2, 4, 5],
        [0, 1, 3, 4],
    ]
    assert tap_index((1, 1), (5, 5), (1, 1), (2, 2), (1, 1), (1, 1)).tolist() == [[12]]  # the centre tap only


def test_large_maps_keep_the_plain_convolution(monkeypatch: pytest.MonkeyPatch) -> None:
    m = use_matmul_depthwise(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)))[0]
    monkeypatch.setattr(DepthwiseAsMatmul, "apply", lambda *a: pytest.fail("used the matrices"))
    m(torch.randn(2, 4, 9, 8))  # 72 pixels


BF16_U = 2**-8  # bfloat16's unit roundoff: 8 significant bits


def assert_within_bfloat16(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """`got`, a bfloat16 kernel's sums of `terms` products, against the exact sums of the same bfloat16 operands.

    Which kernel the CPU runs decides the order of the additions and how many partial sums are rounded to
    bfloat16 (native avx512_bf16, AVX-512 without it and AVX2 differ), so two correct results need not agree
    to the bit or to one rounding of the value: where terms cancel, the exact sum is near zero and the error
    is not. What every order promises is bounded by the terms' magnitude, `magnitude` = the same sums over
    absolute values: Higham and Mary's probabilistic bound, 2 sqrt(n) u of it per element (SIAM J. Sci.
    Comput. 41(5), 2019). That bound would let one small wrong tap through, so the error's norm is held to
    two roundings of the result's norm, 2u: every kernel here stays under 1.4u (measured with the kernels
    held to AVX2, where the input's gradient is summed in bfloat16).
    """
    err = (got.detach().double() - exact).abs()
    bound = 2 * terms**0.5 * BF16_U * magnitude
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements beyond 2 sqrt({terms}) u of their terms"
    assert float(err.norm() / exact.norm()) <= 2 * BF16_U


def test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d() -> None:
    """bfloat16 operands and output, the same bfloat16 tensors saved for backward, and the output and both
    gradients what bfloat16 promises against the exact sums (assert_within_bfloat16): the matrices' and
    oneDNN's or ATen's conv2d, whichever this CPU runs, each held to the exact answer, not to each other."""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 5, padding=2, groups=32, bias=False)
    matmul = use_matmul_depthwise(nn.Sequential(copy.deepcopy(conv)))[0]
    x = torch.randn(16, 32, 4, 4, requires_grad=True)
    results, saved, ran = [], [], []
    for m in (conv, matmul):
        kept: list[tuple[torch.dtype, tuple[int, ...]]] = []

        def pack(t: torch.Tensor, kept: list = kept) -> torch.Tensor:
            if t.is_floating_point():
                kept.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        ran.append(type(out.grad_fn).__name__)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        results.append((out.float(), *torch.autograd.grad((out.float() * weights).sum(), (x, m.weight))))
        saved.append(sorted(kept, key=str))
    assert ran == ["ConvolutionBackward0", "DepthwiseAsMatmulBackward"]
    assert saved[0] == saved[1] == [(torch.bfloat16, (16, 32, 4, 4)), (torch.bfloat16, (32, 1, 5, 5))]
    # The exact sums in float64 of what autocast hands the kernels: the bfloat16 input, weight and output gradient.
    xb, wb = x.detach().bfloat16().double(), conv.weight.detach().bfloat16().double()
    gb = weights.bfloat16().double()
    conv_args = {"padding": 2, "groups": 32}
    exact = (
        F.conv2d(xb, wb, **conv_args),
        torch.nn.grad.conv2d_input(xb.shape, wb, gb, **conv_args),
        torch.nn.grad.conv2d_weight(xb, wb.shape, gb, **conv_args),
    )
    magnitude = (
        F.conv2d(xb.abs(), wb.abs(), **conv_args),
        torch.nn.grad.conv2d_input(xb.shape, wb.abs(), gb.abs(), **conv_args),
        torch.nn.grad.conv2d_weight(xb.abs(), wb.shape, gb.abs(), **conv_args),
    )
    terms = (25, 25, 16 * 4 * 4)  # taps per output pixel and per input pixel; images x pixels per weight tap
    for result in results:
        for got, want, mag, n in zip(result, exact, magnitude, terms, strict=True):
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert_within_bfloat16(got, want, mag, n)


def test_the_model_uses_the_matrices_on_the_cpu_only_and_trains_the_same() -> None:
    """The matrices train as exactly as the plain convolution: each float32 loss and gradient is held to the float64
    answer, not to the other's bits. Float32 itself is only so close on this network: its loss to 1e-6 and its
    gradient to 2.5-4.7e-6 of the float64 one (measured with ATen and oneDNN at AVX-512, AVX2 and default), so
    the loss is held to 1e-5 and the matrices' gradient to twice the plain kernels' own error (1.2x at most)."""
    cpu = build_model(MODEL, "group", SEED)
    assert sum(type(m) is SmallMapDepthwiseConv2d for m in cpu.modules()) == 16  # every block's depthwise conv
    meta = build_model(MODEL, "group", SEED, device="meta")  # a GPU's model: timm's own
    assert not any(type(m) is SmallMapDepthwiseConv2d for m in meta.modules())
    plain = copy.deepcopy(cpu)
    for m in plain.modules():
        if type(m) is SmallMapDepthwiseConv2d:
            m.__class__ = nn.Conv2d
    x, y = torch.randn(4, 1, 28, 28), torch.arange(4)
    losses, grads = [], []
    for m, inputs in ((plain, x), (cpu, x), (copy.deepcopy(plain).double(), x.double())):
        loss = F.cross_entropy(m.train()(inputs), y)
        losses.append(loss.item())
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(m.parameters()))]))
    exact_loss, exact_grad = losses[2], grads[2]
    assert losses[0] == pytest.approx(exact_loss, rel=1e-5) and losses[1] == pytest.approx(exact_loss, rel=1e-5)
    assert relative_difference(grads[1], exact_grad) <= 2 * relative_difference(grads[0], exact_grad)
