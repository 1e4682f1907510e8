"""Model building: timm's efficientnet_b0 for 1-channel 28x28 digits, with BatchNorm or GroupNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import timm
import torch
from timm.layers import BatchNormAct2d, GroupNormAct, set_reentrant_ckpt
from torch import nn

from gradaccum.depthwise import use_matmul_depthwise
from gradaccum.refusal import BadInput

if TYPE_CHECKING:
    from gradaccum.params import Model
    from gradaccum.spec import RunSpec

IMAGE_SIZE = 28  # MNIST and Fashion-MNIST alike


class ModelInputError(BadInput, ValueError):
    """The model cannot take the data's images (28x28, one channel)."""


def batchnorm_to_groupnorm(module: nn.Module, num_groups: int, keep_act: bool = True) -> nn.Module:
    """Swap every BatchNorm2d for GroupNorm(num_groups), in place, keeping what else the layer did.

    timm fuses the activation into the norm (BatchNormAct2d: norm, then SiLU or Identity). A
    plain `nn.GroupNorm` in its place, as the tutorial's swap does (keep_act=False), silently
    drops those 49 activation modules of efficientnet_b0, 33 of them SiLU; GroupNormAct keeps
    them. Affine weights carry over, so the parameter count is unchanged (GroupNorm has one
    scale and shift per channel, like BatchNorm).
    """
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            if isinstance(child, BatchNormAct2d) and keep_act:
                new: nn.Module = GroupNormAct(child.num_features, num_groups, eps=child.eps, affine=child.affine)
                new.drop, new.act = child.drop, child.act
            else:
                new = nn.GroupNorm(num_groups, child.num_features, eps=child.eps, affine=child.affine)
            if child.affine:
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            batchnorm_to_groupnorm(child, num_groups, keep_act)
    return module


def build_model(
    model: Model,
    norm: str,
    seed: int,
    *,
    swap: str = "keep_act",
    checkpointing: bool = False,
    device: torch.device | str = "cpu",
    matmul_depthwise: bool = True,
) -> nn.Module:
    """Same seed, same initial weights for every variant; never downloads (pretrained=False).

    swap="plain" is the tutorial's BatchNorm -> nn.GroupNorm swap, which drops timm's fused activations.
    checkpointing: timm's activation checkpointing of the blocks (non-reentrant): the block activations
    are recomputed in backward instead of kept, memory for compute.
    Returned on `device`; on the CPU its depthwise convolutions on small maps run as matrix products
    (gradaccum/depthwise.py: the same sums, 1.9-2.6x faster training there) unless matmul_depthwise
    is false; on a GPU exactly timm's model, as the tutorial ran it.
    """
    torch.manual_seed(seed)
    net = timm.create_model(model.name, pretrained=False, in_chans=model.in_chans, num_classes=model.num_classes)
    if norm == "group":
        batchnorm_to_groupnorm(net, model.group_norm_groups, keep_act=swap == "keep_act")
    if checkpointing:
        set_reentrant_ckpt(False)  # timm's default too; said here, since reentrant checkpointing differs
        net.set_grad_checkpointing(True)
    if matmul_depthwise and torch.device(device).type == "cpu":
        use_matmul_depthwise(net)
    return net if torch.device(device).type == "cpu" else net.to(device)  # built there; a fake one can't move


def spec_model(spec: RunSpec, seed: int | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """The spec's model as its device trains it (on a CPU with matrix-product depthwise convolutions), initialised
    from `seed`, the spec's own unless another seed's run asks; built on `device`, which a trace makes fake."""
    return build_model(
        spec.model,
        spec.norm,
        spec.seed if seed is None else seed,
        swap=spec.swap,
        checkpointing=spec.checkpointing,
        device=device,
        matmul_depthwise=spec.device == "cpu",
    )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_input(model: Model) -> None:
    """Refuse, before any work, params.yaml's model when it cannot take one 28x28 image: built and run on the meta
    device, where tensors have shapes and no storage (0.1 s for efficientnet_b0, no memory, whatever its size)."""
    try:
        with torch.device("meta"), torch.no_grad():
            net = build_model(model, "batch", seed=0, device="meta")
            net.eval()(torch.empty(1, model.in_chans, IMAGE_SIZE, IMAGE_SIZE))
    except Exception as err:  # timm's models fail in many ways on a too-small or wrong input
        raise ModelInputError(
            f"params.yaml: model.name = {model.name!r} cannot take the data's {IMAGE_SIZE}x{IMAGE_SIZE} "
            f"single-channel images ({type(err).__name__}: {str(err).splitlines()[0][:160]}); allowed: a timm "
            "model whose forward accepts them, e.g. efficientnet_b0, resnet18"
        ) from None
