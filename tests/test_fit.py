"""`python -m gradaccum.fit MODEL`: will a training step of any model fit a card, traced without a GPU."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import allocator, autocast_policy, cli, fit, trace
from gradaccum.accumulation import micro_batch_size, previous_accum
from gradaccum.refusal import REFUSED

MIB = 2**20


def linear(inputs: int = 3 * 8 * 8, outputs: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, outputs, bias=False))


def loader_step(build: Callable[[], nn.Module], dtype: torch.dtype | None, **changes: Any) -> trace.TracedStep:
    """A step of 512 3x8x8 inputs as a DataLoader delivers them (float32, nothing resident), SGD, accum 1."""
    return trace.TracedStep(
        build=build,
        micro=512,
        accum=1,
        num_classes=10,
        dtype=dtype,
        input=(3, 8, 8),
        arrives="float32",
        optimizer="sgd",
        **changes,
    )


def test_a_dataloaders_batch_arrives_each_step_as_float32_of_the_inputs_shape() -> None:
    """A linear model, float32, SGD: weights, gradients, the float32 batch (the layer saves it) and the logits."""
    step = loader_step(linear, None)
    r = trace.trace_step(step)
    weights = 3 * 8 * 8 * 10 * 4 / MIB
    batch = 512 * 3 * 8 * 8 * 4 / MIB
    assert r["parameters_mib"] == pytest.approx(weights) and r["optimizer_mib"] == 0  # plain SGD keeps no state
    assert r["data_mib"] == 0  # nothing resident
    assert r["activations_mib"] + r["temporaries_mib"] >= batch  # the batch itself is live through backward
    momentum = trace.trace_step(replace(step, optimizer="sgd-momentum"))
    assert momentum["optimizer_mib"] == pytest.approx(weights)  # one buffer per parameter
    adam = trace.trace_step(replace(step, optimizer="adam"))
    assert adam["optimizer_mib"] == pytest.approx(2 * weights, rel=0.01)  # two moments (and a step count)


def test_adafactor_keeps_a_row_and_a_column_of_each_matrixs_second_moment() -> None:
    """torch's Adafactor on a 4096 x 192 weight: row and column variances, 4096 + 192 floats (and a step count),
    where Adam keeps two moments of 786432; its step reads norms as numbers, which fake tensors are read as 1.0."""
    wide = replace(loader_step(partial(linear, outputs=4096), None), optimizer="adafactor")
    for policy in (autocast_policy.CPU, autocast_policy.CUDA):  # one tensor at a time, and CUDA's foreach
        assert trace.trace_step(wide, policy)["optimizer_mib"] == pytest.approx((4096 + 192 + 1) * 4 / MIB, abs=1e-3)


def test_the_answer_has_every_figure_and_a_card_answer_that_fits_its_own_trace() -> None:
    q = fit.Question(model="test_resnet", input=(3, 32, 32), num_classes=10, batch=64, cards=(0.55, 80.0), margin=0.0)
    a = fit.answer(q)
    assert {"allocated_mib", "reserved_mib", "nvidia_smi_mib", "tensors_mib", "cards"} <= set(a)
    assert a["allocated_mib"] <= a["reserved_mib"] < a["nvidia_smi_mib"]
    assert a["nvidia_smi_mib"] == pytest.approx(a["reserved_mib"] + allocator.CUDA_CONTEXT / MIB, abs=0.1)
    assert set(a["tensors_mib"]) >= {"weights", "gradients", "optimizer state", "activations", "temporaries"}
    small, large = a["cards"]
    assert large["fits"] and large["smallest_accum"]["accum"] == 1
    assert not small["fits"]  # 563 MiB usable: the context alone takes 500
    best = small["smallest_accum"]
    if best is not None:  # the suggested accum was traced itself, and the one below it does not fit
        assert best["nvidia_smi_mib"] <= small["usable_mib"] and best["accum"] > 1
        engine = fit.question_engine(q)
        below = micro_batch_size(64, best["accum"]) + 1
        assert engine.trace(below, 2)["gpu_nvidia_smi_mib"] > small["usable_mib"] or below > 64
    assert (
        "with_checkpointing" in small
        and small["other_precision"] is None
        or small["other_precision"]["amp"] == "float32"
    )


def test_the_smallest_accum_is_traced_and_raised_until_it_fits() -> None:
    """A line proposes, the card decides: the answer's own step fits the card, the next larger micro-batch's does
    not, and no smaller accum has the answer's micro-batch."""
    q = fit.Question(model="test_efficientnet", input=(3, 64, 64), num_classes=10, batch=256, cards=(80.0,))
    whole = fit.question_engine(q).need(1)
    half = (whole + allocator.CUDA_CONTEXT / MIB) / 2 / 1024  # a card about half what the whole batch needs
    engine = fit.question_engine(replace(q, cards=(half,), margin=0.0))
    (usable,) = engine.cards_mib
    accum = engine.smallest_accum_by_replay(usable)
    assert accum is not None and 1 < accum < 256
    assert engine.fits(accum, usable) and not engine.fits(previous_accum(256, accum), usable)
    assert micro_batch_size(256, accum - 1) > micro_batch_size(256, accum)


def test_the_gpu_sets_the_cublas_workspace_and_the_card() -> None:
    q = fit.Question(model="test_resnet", input=(3, 32, 32), num_classes=10, batch=16, cards=(80.0,))
    h100 = fit.answer(q)
    a100 = fit.answer(replace(q, gpu=allocator.GPUS["a100-40gb"]))
    workspaces = allocator.CUBLAS_WORKSPACES * (allocator.CUBLAS_WORKSPACE - allocator.CUBLAS_WORKSPACE_BEFORE_SM90)
    assert h100["allocated_mib"] - a100["allocated_mib"] == pytest.approx(workspaces / MIB, abs=0.1)
    assert a100["gpu"].startswith("A100 40GB")


def test_a_model_that_reads_values_while_built_is_built_for_real_then_made_fake() -> None:
    """torchvision's vit_b_16 cannot be built under fake tensors; its weights are real, then faked: 86.6 M of them."""
    a = fit.answer(
        fit.Question(model="torchvision:vit_b_16", input=(3, 224, 224), num_classes=1000, batch=2, cards=(80.0,))
    )
    assert a["tensors_mib"]["weights"] == pytest.approx(86_567_656 * 4 / MIB, rel=0.01)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_such_model_xyz"], "no_such_model_xyz: not a timm model"),
        (["torchvision:resnet18"], "torchvision's models take 3 input channels, not --input 1x28x28"),
        (["torchvision:resnet18", "--input", "3x32x32", "--checkpointing"], "torchvision has none"),
        (["test_vit", "--input", "3x4x4", "--batch", "2"], "test_vit: cannot be traced (AssertionError: Input height"),
    ],
)
def test_a_model_that_cannot_be_traced_is_refused_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == REFUSED and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_json_is_one_object_and_the_text_names_each_card(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["test_resnet", "--input", "3x32x32", "--batch", "32", "--cards", "0.55", "80", "--json"])
    a = json.loads(capsys.readouterr().out)
    assert [c["card_gb"] for c in a["cards"]] == [0.55, 80.0] and a["cards"][1]["fits"]
    argv = ["--cards", "80", "--optimizer", "sgd", "--amp", "bfloat16", "--channels-last"]
    cli.main(["test_resnet", "--input", "3x32x32", "--batch", "32", *argv])
    out = capsys.readouterr().out
    assert "80 GB card" in out and "fits" in out and "max_memory_allocated" in out
    assert "bfloat16 autocast, sgd, channels-last" in out


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        cli.main(["test_resnet", "--input", "224x224"])
    with pytest.raises(SystemExit):
        cli.main(["test_resnet", "--accum", "0"])


def test_the_studys_step_and_a_questions_step_share_the_engine() -> None:
    """gradaccum.cards answers through fit.spec_engine: the same Engine, its step built from the variant's spec."""
    from gradaccum import params

    p = params.load()
    spec = trace.traced_spec(p, "accumulation", "cpu")
    engine = fit.spec_engine(spec)
    assert engine.policy == autocast_policy.CPU and engine.batch == spec.batch
    row = trace.trace_variant(p, "accumulation", "cpu")
    assert engine.trace(spec.micro_batch, spec.accum)["peak_mib"] == row["peak_mib"]
    assert math.isfinite(engine.need(spec.accum))


def test_every_validation_row_names_its_source_and_a_figure_fit_predicts() -> None:
    """benchmarks/validate.py re-derives docs/validation.md: each row a published figure with its setup."""
    from benchmarks import validate

    assert all(row.source and row.measured in validate.FIGURE and row.mib > 0 for row in validate.ROWS)
    tiny = next(row for row in validate.ROWS if row.model == "deit_tiny_patch16_224")
    assert tiny.torch_version == "1.7.1" and not tiny.fused_attention  # torch 1.7.1 measured it
    assert validate.predict(tiny) == pytest.approx(4212, abs=1)  # the row docs/validation.md shows
    assert len(validate.ROWS) >= 8 and len({row.source for row in validate.ROWS}) >= 3


def test_torch_1_7s_float32_gelu_keeps_the_mlps_hidden_layer_in_four_bytes() -> None:
    """A linear, a GELU, a linear, float16 autocast: under torch 1.7's rules the GELU saves a float32 copy of its
    (512, 256) input where torch 2.14's saves the float16 one (the float16 copy the second linear saves is there
    either way): 2 more bytes an element live into backward, where its float32 gradient adds more."""

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 256), nn.GELU(), nn.Linear(256, 10))

    step = loader_step(mlp, torch.float16)
    now, then = (trace.trace_step(replace(step, torch_version=v), autocast_policy.CUDA) for v in ("2.14.1", "1.7.1"))
    assert then["peak_mib"] - now["peak_mib"] >= 512 * 256 * 2 / MIB
    assert "as of torch 1.7.1" in then["autocast_policy"] and "gelu in float32" in then["autocast_policy"]


def test_before_torch_2_zero_grad_kept_the_gradients_through_the_next_step() -> None:
    """A linear model, float32, SGD, accum 1: torch 1.13's zero_grad() zeroes the gradient and keeps it, so the whole
    gradient is live at the peak; torch 2.0's frees it, and the peak sees none until backward makes it."""
    step = loader_step(linear, None, torch_version="1.13.1")
    weights = 3 * 8 * 8 * 10 * 4 / MIB
    assert not step.set_to_none and trace.trace_step(step)["gradients_mib"] == pytest.approx(weights)
    later = replace(step, torch_version="2.0.0")
    assert later.set_to_none and trace.trace_step(later)["gradients_mib"] < weights


def test_a_loop_that_keeps_its_gradients_keeps_them_whatever_the_torch() -> None:
    """zero_grad(set_to_none=False), or none at all (milabench's loops): the gradient is live at the peak on torch 2
    as torch 1.13's default kept it; asked not to, torch 1.13's step frees it."""
    weights = 3 * 8 * 8 * 10 * 4 / MIB
    kept = loader_step(linear, None, keep_grads=True)
    assert not kept.set_to_none and trace.trace_step(kept)["gradients_mib"] == pytest.approx(weights)
    freed = loader_step(linear, None, torch_version="1.13.1", keep_grads=False)
    assert freed.set_to_none and trace.trace_step(freed)["gradients_mib"] < weights


def test_a_loop_that_holds_the_output_holds_the_logits_through_backward() -> None:
    """`out = model(x); loss(out).backward()`: the logits stay live beside backward's own gradients, where a loop
    that keeps only the loss frees them once log_softmax has saved its output: the logits' bytes more."""
    wide = partial(linear, outputs=4096)
    freed, held = (trace.trace_step(loader_step(wide, None, hold_output=h)) for h in (False, True))
    assert held["peak_mib"] - freed["peak_mib"] == pytest.approx(512 * 4096 * 4 / MIB)


def test_the_loops_habits_are_named_in_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["test_resnet", "--input", "3x32x32", "--batch", "32", "--cards", "80", "--keep-grads", "--hold-output"])
    assert "gradients kept between steps, the output held through backward" in capsys.readouterr().out
    cli.main(["test_resnet", "--input", "3x32x32", "--batch", "32", "--cards", "80", "--torch", "1.13.1", "--json"])
    assert json.loads(capsys.readouterr().out)["keep_grads"] is True  # torch 1.13's zero_grad kept them


def test_a_batch_cast_on_its_way_to_the_gpu_keeps_no_float32_copy() -> None:
    """`.to(device, float16)` under float16 autocast: the first layer saves the batch itself, where a float32 batch
    stays live beside the float16 copy autocast makes for the layer: the float32 batch's bytes fewer."""
    step = loader_step(linear, torch.float16)
    full, half = (trace.trace_step(replace(step, arrives=d), autocast_policy.CUDA) for d in ("float32", "float16"))
    assert full["activations_mib"] - half["activations_mib"] == pytest.approx(512 * 3 * 8 * 8 * 4 / MIB)


def test_a_model_without_checkpointing_that_does_not_fit_is_answered_without_that_lever(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torchvision has no checkpointing switch: a card it does not fit gets the other answers, and no crash."""
    cli.main(["torchvision:resnet18", "--input", "3x32x32", "--batch", "64", "--cards", "0.5"])
    out = capsys.readouterr().out
    assert "0.5 GB card" in out and "does not fit at accum 1" in out and "with checkpointing" not in out


def test_the_smallest_accum_is_the_smallest_even_when_a_larger_one_was_asked() -> None:
    q = fit.Question(model="test_resnet", input=(3, 32, 32), num_classes=10, batch=64, accum=8, cards=(80.0,))
    (card,) = fit.answer(q)["cards"]
    assert card["fits"] and card["smallest_accum"]["accum"] == 1


def test_a_card_that_fits_only_by_freeing_the_cache_says_so() -> None:
    """The answer names the slower path wherever the allocator had to free its cache (allocator.on_card)."""
    q = fit.Question(model="test_resnet", input=(3, 32, 32), num_classes=10, batch=64, cards=(80.0,))
    a = fit.answer(q)
    assert a["cards"][0]["fits"] and a["cards"][0]["cache_frees"] == 0 and fit.FREES not in fit.printout(a)
    a["cards"][0]["cache_frees"] = 1
    a["cards"][0]["smallest_accum"]["cache_frees"] = 2
    assert fit.printout(a).splitlines()[-1].count(fit.FREES) == 2
