"""Accumulated gradients equal full-batch gradients (GroupNorm), and the window arithmetic is exact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.accumulation import (
    accumulated_gradient,
    micro_batch_size,
    relative_difference,
    schedule,
    steps_per_epoch,
    windows,
)
from gradaccum.models import build_model

ARGS = {"name": "efficientnet_b0", "in_chans": 1, "num_classes": 10, "seed": 99, "group_norm_groups": 1}
BATCH = 24


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


@pytest.fixture(scope="module")
def gn_model() -> nn.Module:
    return build_model(**ARGS, norm="group").train()


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("accum", [1, 2, 3, 4, 7])
def test_groupnorm_accumulated_equals_full_batch(gn_model: nn.Module, batch, accum: int) -> None:
    x, y = batch
    gn_model.zero_grad()
    F.cross_entropy(gn_model(x), y).backward()  # the large-batch gradient, computed directly
    full = flat_grad(gn_model).clone()
    assert relative_difference(accumulated_gradient(gn_model, x, y, accum), full) <= 1e-5


def test_short_last_window_is_exact(gn_model: nn.Module, batch) -> None:
    """22 samples, micro-batch 4, accum 2: the last window holds 6 samples (4 + 2) and must weigh them as 6."""
    x, y = batch[0][:22], batch[1][:22]
    last = windows(22, 4, 2)[-1]
    assert [(m.start, m.stop) for m in last] == [(16, 20), (20, 22)]
    gn_model.zero_grad()
    for mb in last:
        (F.cross_entropy(gn_model(x[mb.start : mb.stop]), y[mb.start : mb.stop]) * mb.weight).backward()
    accumulated = flat_grad(gn_model).clone()
    gn_model.zero_grad()
    F.cross_entropy(gn_model(x[16:22]), y[16:22]).backward()
    assert relative_difference(accumulated, flat_grad(gn_model)) <= 1e-5
    gn_model.zero_grad()
    for mb in last:  # the tutorial's weighting: loss / accum
        (F.cross_entropy(gn_model(x[mb.start : mb.stop]), y[mb.start : mb.stop]) / 2).backward()
    assert relative_difference(flat_grad(gn_model), accumulated) > 1e-2


def test_batchnorm_differs(batch) -> None:
    x, y = batch
    bn = build_model(**ARGS, norm="batch").train()
    full = accumulated_gradient(bn, x, y, 1)
    assert relative_difference(accumulated_gradient(bn, x, y, 4), full) > 1e-2


@pytest.mark.parametrize(
    ("n", "batch", "accum"),
    [(60000, 32768, 8), (60000, 32768, 4), (4000, 1024, 3), (10, 10, 10), (1000, 64, 7), (5, 64, 1)]
    + [(1001, 100, accum) for accum in range(1, 8)],  # accum 1 to 7, n not divisible by the micro-batch
)
def test_windows_cover_every_sample_once_and_weights_sum_to_one(n: int, batch: int, accum: int) -> None:
    micro = micro_batch_size(batch, accum)
    plan = windows(n, micro, accum)
    flat = [mb for w in plan for mb in w]
    assert [mb.start for mb in flat] == list(range(0, n, micro))
    assert flat[-1].stop == n and all(a.stop == b.start for a, b in zip(flat, flat[1:], strict=False))
    assert all(len(w) <= accum for w in plan)
    assert all(math.isclose(sum(mb.weight for mb in w), 1.0) for w in plan)
    assert len(plan) == steps_per_epoch(n, micro, accum) == math.ceil(math.ceil(n / micro) / accum)


def test_tutorial_example_steps_at_epoch_end() -> None:
    """accum 8 at batch 32768: micro-batch 4096, 15 per epoch -> 2 steps, the second over 7 micro-batches."""
    plan = windows(60000, micro_batch_size(32768, 8), 8)
    assert micro_batch_size(32768, 8) == 4096
    assert [len(w) for w in plan] == [8, 7]
    assert plan[-1][-1].stop == 60000  # the epoch's last micro-batch closes a window: nothing spills over


@pytest.mark.parametrize(
    ("batch", "accum", "micro"), [(32768, 4, 8192), (32768, 3, 10923), (1024, 1, 1024), (1024, 1024, 1), (100, 7, 15)]
)
def test_micro_batch_is_ceil(batch: int, accum: int, micro: int) -> None:
    assert micro_batch_size(batch, accum) == micro


@pytest.mark.parametrize("accum", [0, 1025])
def test_micro_batch_rejects_out_of_range(accum: int) -> None:
    with pytest.raises(ValueError, match="from 1 to the batch size 1024"):
        micro_batch_size(1024, accum)


def test_tutorial_schedule_divides_by_accum_and_carries_the_rest() -> None:
    """70 samples, micro-batches of 10, accum 3: steps after the 3rd and 6th; the 7th is carried over."""
    tutorial = schedule(70, 10, 3, weighting="divide", epoch_end_step=False)
    assert [mb.step for mb in tutorial] == [False, False, True] * 2 + [False]
    assert all(mb.weight == pytest.approx(1 / 3) for mb in tutorial)
    exact = schedule(70, 10, 3)
    assert [mb.step for mb in exact] == [False, False, True] * 2 + [True]  # every epoch ends with a step
    assert exact[-1].weight == 1.0 and [mb.start for mb in exact] == [mb.start for mb in tutorial]
    flushed = schedule(70, 10, 3, weighting="divide", epoch_end_step=True)
    assert flushed[-1].step and flushed[-1].weight == pytest.approx(1 / 3)  # one correction alone
    with pytest.raises(ValueError, match="weighting must be one of exact, divide"):
        schedule(70, 10, 3, weighting="mean")


def test_tutorial_weighting_is_off_on_a_short_micro_batch(gn_model: nn.Module, batch) -> None:
    x, y = batch  # 24 samples: accum 5 gives micro-batches of 5, 5, 5, 5 and a short 4; accum 3 gives 8, 8, 8
    full = accumulated_gradient(gn_model, x, y, 1)
    assert relative_difference(accumulated_gradient(gn_model, x, y, 5, weighting="divide"), full) > 1e-3
    assert relative_difference(accumulated_gradient(gn_model, x, y, 5), full) <= 1e-5
    assert relative_difference(accumulated_gradient(gn_model, x, y, 3, weighting="divide"), full) <= 1e-5
