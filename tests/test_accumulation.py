"""Accumulated gradients equal full-batch gradients (GroupNorm), measured through the training loop itself
(gradaccum/loop.py's train_epoch, shuffled), and the window arithmetic is exact."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradaccum.accumulation import (
    accum_for,
    fewest_for_micro,
    micro_batch_size,
    next_accum,
    previous_accum,
    relative_difference,
    schedule,
    windows,
)
from gradaccum.gradcheck import full_gradient, loop_gradients, window_differences
from gradaccum.models import build_model
from gradaccum.params import Model

MODEL = Model(name="efficientnet_b0", in_chans=1, num_classes=10, group_norm_groups=1)
N, BATCH = 44, 24  # an epoch of two windows: 24 samples, then a short one of 20


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 images as training holds them, labels, and a shuffled order of the epoch."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (N, 28, 28), dtype=torch.uint8, generator=g)
    return images, torch.randint(0, 10, (N,), generator=g), torch.randperm(N, generator=g)


@pytest.fixture(scope="module")
def gn_model() -> nn.Module:
    return build_model(MODEL, "group", 99)


@pytest.mark.parametrize("accum", [1, 2, 3, 4, 7])
def test_the_loops_window_gradient_is_the_full_batch_gradient_of_its_samples(
    gn_model: nn.Module, digits, accum: int
) -> None:
    """train_epoch with a recording stand-in optimizer, over a shuffled epoch of a full window and a short one
    (accum 4: micro-batches of 6, windows of 24 and 20, the last micro-batch 2; accum 7: of 4, windows of 28
    and 16): each window's gradient is the gradient of the mean loss over the same shuffled samples."""
    images, labels, perm = digits
    micro = micro_batch_size(BATCH, accum)
    diffs = window_differences(gn_model, images, labels, perm, micro, accum)
    assert len(diffs) == 2 and max(diffs) <= 1e-5


def test_the_loop_follows_the_shuffle(gn_model: nn.Module, digits) -> None:
    """The same windows in the unshuffled order hold other samples: their gradients are far apart, so a loop
    that ignored its permutation would fail the test above."""
    images, labels, perm = digits
    got = loop_gradients(gn_model, images, labels, perm, 6, 4)
    unshuffled = full_gradient(gn_model, images[:BATCH], labels[:BATCH])
    assert relative_difference(got[0], unshuffled) > 1e-2


def test_batchnorm_differs(digits) -> None:
    images, labels, perm = digits
    bn = build_model(MODEL, "batch", 99)
    assert min(window_differences(bn, images, labels, perm, 6, 4)) > 1e-2


def test_tutorial_weighting_is_off_on_a_short_micro_batch_and_exact_without_one(gn_model: nn.Module, digits) -> None:
    """loss / accum through the loop: micro-batches of 5 over 24 samples leave a short 4 (accum 5), off;
    8, 8, 8 (accum 3) are all full, exact; each micro-batch's share (the default) is exact either way."""
    images, labels, perm = digits
    window = perm[:BATCH]  # one window: the tutorial's weighting is about micro-batches, not windows
    assert max(window_differences(gn_model, images, labels, window, 5, 5, "divide")) > 1e-3
    assert max(window_differences(gn_model, images, labels, window, 5, 5)) <= 1e-5
    assert max(window_differences(gn_model, images, labels, window, 8, 3, "divide")) <= 1e-5


@pytest.mark.parametrize(
    ("n", "batch", "accum", "steps"),  # steps counted by hand: micro-batches of ceil(batch / accum), accum a window
    [(60000, 32768, 8, 2), (60000, 32768, 4, 2), (4000, 1024, 3, 4), (10, 10, 10, 1), (1000, 64, 7, 15)]
    + [(5, 64, 1, 1), (1001, 100, 1, 11), (1001, 100, 2, 11), (1001, 100, 3, 10), (1001, 100, 4, 11)]
    + [(1001, 100, 5, 11), (1001, 100, 6, 10), (1001, 100, 7, 10)],  # n not divisible by the micro-batch
)
def test_windows_cover_every_sample_once_and_weights_sum_to_one(n: int, batch: int, accum: int, steps: int) -> None:
    micro = micro_batch_size(batch, accum)
    plan = windows(n, micro, accum)
    flat = [mb for w in plan for mb in w]
    assert [mb.start for mb in flat] == list(range(0, n, micro))
    assert flat[-1].stop == n and all(a.stop == b.start for a, b in zip(flat, flat[1:], strict=False))
    assert all(len(w) == accum for w in plan[:-1]) and 1 <= len(plan[-1]) <= accum
    assert all(math.isclose(sum(mb.weight for mb in w), 1.0) for w in plan)
    assert len(plan) == steps and [mb.step for mb in flat].count(True) == steps


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


def test_accum_for_is_the_fewest_micro_batches_of_at_most_that_size() -> None:
    """Checked against the definition on every batch to 200: the planner, fit and the benchmarks count on it."""
    for batch in range(1, 201):
        for micro in range(1, batch + 2):
            accum = accum_for(batch, micro)
            assert micro_batch_size(batch, accum) <= micro
            assert accum == 1 or micro_batch_size(batch, accum - 1) > micro  # one fewer would not do
        for accum in range(1, batch + 1):
            micro, fewest = micro_batch_size(batch, accum), fewest_for_micro(batch, accum)
            assert micro_batch_size(batch, fewest) == micro and (
                fewest == 1 or micro_batch_size(batch, fewest - 1) > micro
            )
            if micro > 1:  # the fewest micro-batches of a smaller size
                up = next_accum(batch, accum)
                assert micro_batch_size(batch, up) < micro <= micro_batch_size(batch, up - 1)
            if fewest > 1:
                previous = previous_accum(batch, accum)
                assert micro_batch_size(batch, previous) > micro and fewest_for_micro(batch, previous) == previous
