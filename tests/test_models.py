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

ARGS = {"name": "efficientnet_b0", "in_chans": 1, "num_classes": 10, "seed": 99}


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module]:
    return build_model(**ARGS, norm="batch", group_norm_groups=1), build_model(
        **ARGS, norm="group", group_norm_groups=1
    )


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
    plain = build_model(**ARGS, norm="group", group_norm_groups=1, swap="plain")

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
    plain = build_model(**ARGS, norm="group", group_norm_groups=1).train()
    ckpt = build_model(**ARGS, norm="group", group_norm_groups=1, checkpointing=True).train()
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


def test_under_autocast_the_matrices_do_what_autocast_does_to_conv2d() -> None:
    """bfloat16 operands and output, the same bfloat16 tensors saved for backward; the output and the
    input's gradient to one bfloat16 rounding (8 bits of mantissa: 2^-8 of a value), the weight's
    gradient, 256 bfloat16 products summed in another order, to 1% in norm (measured 0.24-0.28%, 5 seeds)."""
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
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype
    (out_a, dx_a, dw_a), (out_b, dx_b, dw_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=2**-8, atol=0)
    torch.testing.assert_close(dx_b, dx_a, rtol=2**-8, atol=0)
    assert float((dw_b - dw_a).norm() / dw_a.norm()) < 0.01


def test_the_model_uses_the_matrices_on_the_cpu_only_and_trains_the_same() -> None:
    cpu = build_model(**ARGS, norm="group", group_norm_groups=1)
    assert sum(type(m) is SmallMapDepthwiseConv2d for m in cpu.modules()) == 16  # every block's depthwise conv
    meta = build_model(**ARGS, norm="group", group_norm_groups=1, device="meta")  # a GPU's model: timm's own
    assert not any(type(m) is SmallMapDepthwiseConv2d for m in meta.modules())
    plain = copy.deepcopy(cpu)
    for m in plain.modules():
        if type(m) is SmallMapDepthwiseConv2d:
            m.__class__ = nn.Conv2d
    x, y = torch.randn(4, 1, 28, 28), torch.arange(4)
    losses, grads = [], []
    for m in (plain, cpu):
        loss = F.cross_entropy(m.train()(x), y)
        losses.append(loss.item())
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(m.parameters()))]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert relative_difference(grads[1], grads[0]) < 1e-5
