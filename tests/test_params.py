"""Each validation rule stops the run with a message naming the key, the value and what is allowed."""

from __future__ import annotations

import ast
import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from gradaccum import params, spec
from gradaccum.records import Plan

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = yaml.safe_load((ROOT / "params.yaml").read_text())


def with_change(path: str, value: object) -> dict:
    p = copy.deepcopy(DEFAULTS)
    *parents, last = path.split(".")
    node = p
    for key in parents:
        node = node[key]
    node[last] = value
    return p


def error_for(p: dict) -> str:
    with pytest.raises(params.ParamsError) as info:
        params.check(p)
    return str(info.value)


def test_defaults_are_valid() -> None:
    p = params.load(ROOT / "params.yaml")
    assert isinstance(p, params.Params) and p.accum == DEFAULTS["accum"]  # the typed model, not a dict
    assert p.scale_settings("cpu").batch == DEFAULTS["scales"]["cpu"]["batch"]


CPU_BATCH = DEFAULTS["scales"]["cpu"]["batch"]


@pytest.mark.parametrize(("value", "batch"), [(0, ""), (-3, ""), (CPU_BATCH + 1, f" (scales.cpu.batch = {CPU_BATCH})")])
def test_accum_out_of_range_names_the_batch(value: int, batch: str) -> None:
    """Below 1 needs no batch to refuse; above the batch the message names the batch it is over."""
    assert error_for(with_change("accum", value)) == (
        f"params.yaml: accum = {value} is not allowed; expected an integer from 1 to the effective batch size"
        f"{batch}, or auto"
    )


def test_accum_wrong_type() -> None:
    msg = error_for(with_change("accum", "eight"))
    assert "accum = 'eight'" in msg and "got a str" in msg


def test_accum_auto_and_non_divisor_allowed() -> None:
    params.check(with_change("accum", "auto"))
    params.check(with_change("accum", 7))


@pytest.mark.parametrize(
    "key", ["scales.cpu.batch", "scales.study.epochs", "scales.cpu.train_samples", "scales.study.test_samples"]
)
@pytest.mark.parametrize("value", [0, -1])
def test_counts_must_be_positive(key: str, value: int) -> None:
    msg = error_for(with_change(key, value))
    assert f"{key} = {value}" in msg and "positive integer" in msg


def test_float_where_int_expected_says_the_type() -> None:
    msg = error_for(with_change("scales.cpu.epochs", 2.5))
    assert "scales.cpu.epochs = 2.5" in msg and "got a float" in msg


def test_bool_is_not_an_int() -> None:
    msg = error_for(with_change("seed", True))
    assert "seed = True" in msg and "boolean" in msg


@pytest.mark.parametrize("value", [0, -1e-3])
def test_learning_rate_positive(value: float) -> None:
    msg = error_for(with_change("variants.baseline.lr", value))
    assert "variants.baseline.lr" in msg and "positive number" in msg


def test_learning_rate_string_says_type() -> None:
    msg = error_for(with_change("variants.accumulation.lr", "3e-4"))  # YAML reads 3e-4 without a dot as a string
    assert "variants.accumulation.lr = '3e-4'" in msg and "got a str" in msg


def test_unknown_model_lists_close_matches() -> None:
    msg = error_for(with_change("model.name", "efficientnet_b9"))
    assert "model.name = 'efficientnet_b9'" in msg
    assert "close matches:" in msg and "efficientnet_b" in msg.split("close matches:")[1]


def test_stages_that_build_no_model_skip_the_timm_check() -> None:
    """Stages that build no model load params without importing timm; hardware, first in every run, checks it."""
    values = with_change("model.name", "efficientnet_b9")
    assert params.check(values, model_names=False).model.name == "efficientnet_b9"
    for stage in ("download", "report"):
        assert params_load_calls(stage) == [{"model_names": False}], stage
    for stage in ("hardware", "sweep"):  # the sweep checks the model before its points start
        assert params_load_calls(stage) == [{}], stage


def params_load_calls(stage: str) -> list[dict[str, object]]:
    """The keyword arguments of every params.load call in the stage's code, read from its syntax tree
    (a comment or a string that mentions the call is not a call)."""
    tree = ast.parse((ROOT / f"stages/{stage}.py").read_text())
    return [
        {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "params"
    ]


def test_unknown_key_names_the_nearest() -> None:
    p = copy.deepcopy(DEFAULTS)
    p["acum"] = 8
    msg = error_for(p)
    assert "unknown key 'acum'" in msg and "did you mean 'accum'" in msg


def test_unknown_nested_key_names_the_nearest() -> None:
    p = with_change("scales.cpu.epoch", 3)
    msg = error_for(p)
    assert "unknown key 'scales.cpu.epoch'" in msg and "did you mean 'scales.cpu.epochs'" in msg


def test_missing_key() -> None:
    p = copy.deepcopy(DEFAULTS)
    del p["seed"]
    assert "missing key 'seed'" in error_for(p)


def test_choice_lists_allowed_values() -> None:
    msg = error_for(with_change("data.dataset", "cifar10"))
    assert "data.dataset = 'cifar10'" in msg and "mnist, fashion_mnist" in msg


def test_variant_norm_and_extra() -> None:
    assert "expected one of batch, group" in error_for(with_change("variants.baseline.norm", "layer"))
    msg = error_for(with_change("variants.accumulation.extra", "seed"))
    assert "variants.accumulation.extra = 'seed'" in msg and "extra: accum" in msg


def test_variant_fixed_accum_over_batch() -> None:
    msg = error_for(with_change("variants.baseline.accum", 5000))
    assert "variants.baseline.accum = 5000" in msg and f"scales.cpu.batch = {CPU_BATCH}" in msg


def test_yaml_syntax_error_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("accum: [4\n")
    with pytest.raises(params.ParamsError, match="params.yaml: not valid YAML"):
        params.load(bad)


def test_a_refused_value_that_differs_from_git_says_how_to_put_it_back(tmp_path: Path, monkeypatch) -> None:
    """`dvc exp run -S variants.accumulation.lr=-0.001` writes the value before the run refuses it: the line says so."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "params.yaml"], ["commit", "-qm", "params"]):
        subprocess.run(git + args, check=True)
    params.load(model_names=False)  # as committed: valid, nothing said
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text().replace("lr: 3.0e-4", "lr: -0.001", 1))
    with pytest.raises(params.ParamsError) as err:
        params.load(model_names=False)
    assert "-0.001" in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).endswith(
        "params.yaml differs from git HEAD: `dvc exp run -S` writes its values there before running, and keeps them "
        "when refused; `git checkout params.yaml` puts it back)"
    )
    subprocess.run([*git, "commit", "-qam", "the bad value, committed"], check=True)
    with pytest.raises(params.ParamsError) as committed:
        params.load(model_names=False)
    assert "git HEAD" not in str(committed.value)  # committed on purpose: nothing to put back


def test_scale_resolution() -> None:
    p = params.check(copy.deepcopy(DEFAULTS))
    assert params.resolve_scale(p, cuda=False) == "cpu"
    assert params.resolve_scale(p, cuda=True) == "study"
    with pytest.raises(params.ParamsError, match="scale = 'study'.*needs a CUDA GPU"):
        params.resolve_scale(params.check(with_change("scale", "study")), cuda=False)


def test_variant_accum_follows_top_level_key() -> None:
    p = params.check(with_change("accum", 8))
    assert spec.variant_accum(p, "accumulation", None, "cpu", 1) == 8
    assert spec.variant_accum(p, "baseline", None, "cpu", 1) == 1
    auto = params.check(with_change("accum", "auto"))
    line = {"fixed_mib": 100.0, "per_sample_mib": 1.0}
    budget = {"what": "host memory", "memory_mib": 1000.0, "safety_margin": 0.1}
    autos = {"auto_accum": 3, "auto_accum_checkpointing": 2}
    sweep = {"format": 2, "device": "cpu", "scale": "cpu", "batch": 256, "measure": "peak RSS", "points": []}
    plan = Plan(**sweep, line=line, line_checkpointing=line, this_machine=budget, **autos)
    assert spec.variant_accum(auto, "accumulation", plan, "cpu", 1) == 3
    assert spec.variant_accum(auto, "accum_checkpointing", plan, "cpu", 1) == 2
    with pytest.raises(params.ParamsError, match="accum = 'auto' needs the memory planner"):
        spec.variant_accum(auto, "accumulation", None, "cpu", 1)
    nothing = plan.model_copy(update={"auto_accum": None})
    with pytest.raises(params.ParamsError, match=r"finds nothing that fits \(accumulation\).* 900 MiB"):
        spec.variant_accum(auto, "accumulation", nothing, "cpu", 1)


def test_a_variant_that_differs_only_in_its_lr_shares_its_step() -> None:
    p = params.check(DEFAULTS)
    assert spec.step_twin(p, "batchnorm_lr") == "baseline"  # BatchNorm, accum 1: the lr alone differs
    assert spec.step_twin(p, "baseline") is None  # the first of the two is measured
    assert spec.step_twin(p, "groupnorm") is None  # the norm differs
    assert spec.step_twin(p, "checkpointing") is None  # so does a lever, at the same lr as groupnorm
    moved = params.check(with_change("variants.batchnorm_lr.accum", 2))
    assert spec.step_twin(moved, "batchnorm_lr") is None


def test_set_values_like_dvc_exp_run() -> None:
    raw = copy.deepcopy(DEFAULTS)
    p = params.set_values(raw, ["accum=8", "scales.cpu.sweep_micro_batches=[8, 16]"])
    assert p.accum == 8 and p.scales.cpu.sweep_micro_batches == [8, 16]
    assert raw["accum"] == 8  # the plain values changed too: what `python -m gradaccum.params -S` writes back
    with pytest.raises(params.ParamsError, match="'scales.cpu.epoch': unknown key; did you mean 'scales.cpu.epochs'"):
        params.set_values(copy.deepcopy(DEFAULTS), ["scales.cpu.epoch=2"])
    with pytest.raises(params.ParamsError, match="expected KEY=VALUE"):
        params.set_values(copy.deepcopy(DEFAULTS), ["accum"])


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("memory.cards_gb", [8, -1], "memory.cards_gb[1] = -1 is not allowed; expected a positive number (above 0)"),
        ("memory.cards_gb", [], "memory.cards_gb = [] is not allowed; expected a non-empty list of card sizes in GB"),
        (
            "scales.cpu.sweep_micro_batches",
            [64, "x"],
            "scales.cpu.sweep_micro_batches[1] = 'x' is not allowed; expected a positive integer (1 or more), got a",
        ),
        ("memory.safety_margin", 1, "memory.safety_margin = 1 is not allowed; expected a number from 0 up to (not"),
        (
            "train.amp_cpu",
            False,
            "train.amp_cpu = False is not allowed; expected one of bfloat16, float32, got a boolean",
        ),
        ("model", 5, "model = 5 is not allowed; expected a mapping with the keys name, in_chans, num_classes, group_"),
        (
            "variants",
            {},
            "variants = {} is not allowed; expected a mapping of variant name -> {norm, accum, lr, extra}",
        ),
        (
            "variants.baseline.accum",
            0,
            "variants.baseline.accum = 0 is not allowed; expected a positive integer, or accum",
        ),
    ],
)
def test_one_line_message_names_key_value_and_allowed(key: str, value: object, expected: str) -> None:
    msg = error_for(with_change(key, value))
    assert msg.startswith("params.yaml: " + expected) and "\n" not in msg


def test_variant_names_are_identifiers() -> None:
    p = copy.deepcopy(DEFAULTS)
    p["variants"]["bad-name"] = p["variants"]["baseline"]
    msg = error_for(p)
    assert "variants.bad-name = 'bad-name' is not allowed; variant names are 1 to 64 letters, digits and _" in msg


def test_schema_file_is_current_and_accepts_params_yaml() -> None:
    """params.schema.json is what editors check params.yaml against: it must match the pydantic model."""
    written = (ROOT / "params.schema.json").read_text()
    assert written == params.json_schema(), "run: python -m gradaccum.params --schema"
    schema = json.loads(written)
    assert schema["additionalProperties"] is False and set(schema["required"]) == set(DEFAULTS)
    assert schema["$defs"]["Scale"]["properties"]["batch"]["minimum"] == 1


def test_tutorial_switches_default_to_the_corrected_code() -> None:
    p = params.check(copy.deepcopy(DEFAULTS))
    assert p.variants["accumulation"].model_dump() == {
        **DEFAULTS["variants"]["accumulation"],
        "weighting": "exact",
        "epoch_end_step": True,
        "swap": "keep_act",
        "checkpointing": False,
        "precision": "default",
        "cudnn": "default",
    }
    tutorial = p.variants["tutorial_accumulation"]
    assert (tutorial.weighting, tutorial.epoch_end_step, tutorial.swap) == ("divide", False, "plain")
    msg = error_for(with_change("variants.tutorial_accumulation.weighting", "mean"))
    assert "variants.tutorial_accumulation.weighting = 'mean' is not allowed; expected one of exact" in msg
    msg = error_for(with_change("variants.accumulation.epoch_end_step", "no"))
    assert "variants.accumulation.epoch_end_step = 'no' is not allowed; expected true" in msg and "got a str" in msg


def test_checkpointing_is_refused_with_batchnorm() -> None:
    msg = error_for(with_change("variants.baseline.checkpointing", True))
    assert "variants.baseline.checkpointing = True is not allowed; BatchNorm under checkpointing" in msg
    assert "pytorch#96136" in msg
    msg = error_for(with_change("variants.groupnorm_precision.precision", "fp8"))
    assert "variants.groupnorm_precision.precision = 'fp8' is not allowed; expected one of default" in msg


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("variants.baseline.lr", float("inf"), "expected a finite number"),
        ("memory.host_budget_gb", float("nan"), "expected a finite number"),
        ("memory.safety_margin", float("-inf"), "expected a finite number"),
        ("seed", 2**64, "an integer from 0 to 2**32 - 1"),
        ("model.num_classes", 5, "the data has ten classes"),
        ("model.in_chans", 3, "the data's images have one channel"),
        ("scales.cpu.sweep_micro_batches", [64], "a list of two or more positive integers"),
        ("scales.cpu.sweep_micro_batches", [64, 32, 128], "increasing order, each once"),
        ("scales.study.sweep_micro_batches", [256, 256, 512], "increasing order, each once"),
    ],
)
def test_values_that_would_crash_or_mislead_later_are_refused(key: str, value, allowed: str) -> None:
    msg = error_for(with_change(key, value))
    assert msg.startswith(f"params.yaml: {key} = ") and allowed in msg


def test_variant_names_must_make_file_names() -> None:
    p = copy.deepcopy(DEFAULTS)
    p["variants"]["x" * 65] = p["variants"]["baseline"]
    msg = error_for(p)
    assert "variants." + "x" * 65 in msg and "1 to 64 letters, digits and _" in msg
    p["variants"]["x" * 64] = p["variants"].pop("x" * 65)
    assert params.check(p).variants


def test_a_role_naming_no_variant_is_refused_by_name() -> None:
    """Rename a variant and forget its role: one line naming the role, the missing name and the variants there are."""
    p = copy.deepcopy(DEFAULTS)
    p["variants"]["gn"] = p["variants"].pop("groupnorm")
    msg = error_for(p)
    assert msg.startswith("params.yaml: roles.norm_control = 'groupnorm' is not allowed; expected a variant")
    assert "gn" in msg.split("expected a variant of params.yaml: ")[1].split(", ")
    p["roles"]["norm_control"] = "gn"
    p["roles"]["levers"]["missing"] = "a lever"
    assert error_for(p).startswith("params.yaml: roles.levers.missing = 'missing' is not allowed")
    del p["roles"]["levers"]["missing"]
    assert params.check(p).roles.norm_control == "gn"


def test_set_on_the_command_line_keeps_the_comments(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text())
    cmd = [sys.executable, "-m", "gradaccum.params", str(path), "-S", "accum=8", "-S", "memory.sweep_steps=3"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    before, after = (ROOT / "params.yaml").read_text(), path.read_text()
    comments = [line.split("#", 1)[1] for line in before.splitlines() if "#" in line]
    assert all(c in after for c in comments)  # every comment kept, whatever the spacing of the flow mappings
    written = params.load(path)
    assert written.accum == 8 and written.memory.sweep_steps == 3 and written.seed == DEFAULTS["seed"]
    bad = subprocess.run([*cmd[:4], "-S", "accum=0"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "accum = 0 is not allowed" in bad.stderr and params.load(path).accum == 8


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"seeds": 0}, "seeds = 0 is not allowed; expected an integer from 1 to 100"),
        ({"seeds": 101}, "seeds = 101 is not allowed; expected an integer from 1 to 100"),
        ({"seed": 2**32 - 2, "seeds": 3}, "seeds = 3 is not allowed; the seeds run from seed = 4294967294 up, so"),
    ],
)
def test_seeds_are_counted_and_stay_in_range(changes: dict, expected: str) -> None:
    p = copy.deepcopy(DEFAULTS)
    p.update(changes)
    assert error_for(p).startswith("params.yaml: " + expected)
