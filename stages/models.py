"""Model building: timm's efficientnet_b0 for 1-channel 28x28 digits, with BatchNorm or GroupNorm."""

from __future__ import annotations

import timm
import torch
from timm.layers import BatchNormAct2d, GroupNormAct
from torch import nn


def batchnorm_to_groupnorm(module: nn.Module, num_groups: int) -> nn.Module:
    """Swap every BatchNorm2d for GroupNorm(num_groups), in place, keeping what else the layer did.

    timm fuses the activation into the norm (BatchNormAct2d: norm, then SiLU). A plain
    `nn.GroupNorm` in its place, as the tutorial's swap does, silently drops 49 activations of
    efficientnet_b0; GroupNormAct keeps them. Affine weights carry over, so the parameter
    count is unchanged (GroupNorm has one scale and shift per channel, like BatchNorm).
    """
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            if isinstance(child, BatchNormAct2d):
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
            batchnorm_to_groupnorm(child, num_groups)
    return module


def build_model(name: str, in_chans: int, num_classes: int, norm: str, group_norm_groups: int, seed: int) -> nn.Module:
    """Same seed, same initial weights for every variant; never downloads (pretrained=False)."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, in_chans=in_chans, num_classes=num_classes)
    if norm == "group":
        batchnorm_to_groupnorm(model, group_norm_groups)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
