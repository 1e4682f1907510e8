"""Load and validate params.yaml, so a bad value stops the run before any long work starts.

Every rule raises ParamsError with one message naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """A params.yaml value the study cannot run with."""


Rule = Callable[[str, Any], None]


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ParamsError(f"params.yaml: {key} = {value!r} is not allowed; {allowed}")


def _type_name(value: Any) -> str:
    return "boolean" if isinstance(value, bool) else type(value).__name__


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(key: str, value: Any) -> None:
    if not is_int(value):
        _fail(key, value, f"expected a positive integer, got a {_type_name(value)}")
    if value < 1:
        _fail(key, value, "expected a positive integer (1 or more)")


def non_negative_int(key: str, value: Any) -> None:
    if not is_int(value) or value < 0:
        _fail(key, value, f"expected an integer 0 or more, got a {_type_name(value)}")


def positive_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, value, f"expected a positive number, got a {_type_name(value)}")
    if not value > 0:
        _fail(key, value, "expected a positive number (above 0)")


def non_negative_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        _fail(key, value, "expected a number 0 or more")


def fraction(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        _fail(key, value, "expected a number from 0 up to (not including) 1")


def boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(key, value, f"expected true or false, got a {_type_name(value)}")


def string(key: str, value: Any) -> None:
    if not isinstance(value, str):
        _fail(key, value, f"expected a string, got a {_type_name(value)}")


def one_of(*choices: str) -> Rule:
    def rule(key: str, value: Any) -> None:
        if value not in choices:
            _fail(key, value, "expected one of " + ", ".join(choices))

    return rule


def list_of_positive_ints(key: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        _fail(key, value, "expected a non-empty list of positive integers")
    for i, item in enumerate(value):
        positive_int(f"{key}[{i}]", item)


def model_name(key: str, value: Any) -> None:
    string(key, value)
    import timm  # slow import, only when validating

    names = timm.list_models()
    if value not in names:
        close = difflib.get_close_matches(value, names, n=5, cutoff=0.6)
        hint = "close matches: " + ", ".join(close) if close else "see timm.list_models()"
        _fail(key, value, f"not a timm model name; {hint}")


def accum_value(key: str, value: Any) -> None:
    if value == "auto":
        return
    if not is_int(value):
        _fail(key, value, f"expected an integer from 1 to the effective batch size, or auto; got a {_type_name(value)}")
    if value < 1:
        _fail(key, value, "expected an integer from 1 to the effective batch size, or auto")


def card_sizes(key: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        _fail(key, value, "expected a non-empty list of card sizes in GB")
    for i, item in enumerate(value):
        positive_number(f"{key}[{i}]", item)


SCALE: dict[str, Rule] = {
    "train_samples": positive_int,
    "test_samples": positive_int,
    "batch": positive_int,
    "epochs": positive_int,
    "sweep_micro_batches": list_of_positive_ints,
}


def variant_accum(key: str, value: Any) -> None:
    if value != "accum" and not (is_int(value) and value >= 1):
        _fail(key, value, "expected a positive integer, or accum (follow the top-level key)")


VARIANT: dict[str, Rule] = {
    "norm": one_of("batch", "group"),
    "accum": variant_accum,
    "lr": positive_number,
    "extra": string,
}

SCHEMA: dict[str, Any] = {
    "accum": accum_value,
    "seed": non_negative_int,
    "scale": one_of("auto", "study", "cpu"),
    "data": {"dataset": one_of("mnist", "fashion_mnist"), "source": string, "fallback": boolean},
    "scales": {"study": SCALE, "cpu": SCALE},
    "model": {
        "name": model_name,
        "in_chans": positive_int,
        "num_classes": positive_int,
        "group_norm_groups": positive_int,
    },
    "train": {
        "weight_decay": non_negative_number,
        "amp_cuda": one_of("float16", "bfloat16", "float32"),
        "amp_cpu": one_of("bfloat16", "float32"),
        "eval_batch": positive_int,
    },
    "memory": {
        "interval_ms": positive_int,
        "safety_margin": fraction,
        "host_budget_gb": positive_number,
        "cards_gb": card_sizes,
        "sweep_steps": positive_int,
    },
    "variants": "VARIANTS",  # a mapping of name -> VARIANT, checked below
}


def _check_tree(prefix: str, schema: dict[str, Any], values: Any) -> None:
    where = prefix or "the top level"
    if not isinstance(values, dict):
        _fail(prefix, values, f"expected a mapping with keys {', '.join(schema)}")
    for key in values:
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1, cutoff=0.0)
            raise ParamsError(
                f"params.yaml: unknown key {_join(prefix, key)!r} in {where}; "
                f"did you mean {_join(prefix, close[0])!r}? Known keys: {', '.join(schema)}"
            )
    for key, rule in schema.items():
        full = _join(prefix, key)
        if key not in values:
            raise ParamsError(f"params.yaml: missing key {full!r}")
        if isinstance(rule, dict):
            _check_tree(full, rule, values[key])
        elif rule == "VARIANTS":
            _check_variants(full, values[key])
        else:
            rule(full, values[key])


def _check_variants(prefix: str, variants: Any) -> None:
    if not isinstance(variants, dict) or not variants:
        _fail(prefix, variants, "expected a mapping of variant name -> {norm, accum, lr, extra}")
    for name, variant in variants.items():
        if not isinstance(name, str) or not name.replace("_", "").isalnum():
            _fail(f"{prefix}.{name}", name, "variant names are letters, digits and _")
        _check_tree(f"{prefix}.{name}", VARIANT, variant)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def check(params: dict[str, Any]) -> dict[str, Any]:
    """Check every rule that needs no hardware; returns params unchanged."""
    _check_tree("", SCHEMA, params)
    for name, variant in params["variants"].items():
        extra = variant["extra"]
        if extra not in params:
            _fail(f"variants.{name}.extra", extra, "expected a top-level key, one of " + ", ".join(params))
        if variant["accum"] == "accum" and extra != "accum":
            _fail(f"variants.{name}.extra", extra, "a variant with accum: accum must have extra: accum")
    for name, scale in params["scales"].items():
        check_accum(params["accum"], scale["batch"], f"scales.{name}.batch")
        for vname, variant in params["variants"].items():
            if is_int(variant["accum"]):
                check_accum(variant["accum"], scale["batch"], f"scales.{name}.batch", f"variants.{vname}.accum")
    return params


def check_accum(accum: Any, batch: int, batch_key: str, key: str = "accum") -> None:
    if is_int(accum) and not 1 <= accum <= batch:
        _fail(key, accum, f"expected an integer from 1 to the effective batch size ({batch_key} = {batch}), or auto")


def load(path: Path = PARAMS_FILE) -> dict[str, Any]:
    """Read and check params.yaml; a YAML syntax error also names the file."""
    try:
        params = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found; run from the repository root") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    return check(params)


def resolve_scale(params: dict[str, Any], cuda: bool) -> str:
    """The scale that runs here: the study needs a CUDA GPU, everything else gets the CPU scale."""
    scale = params["scale"]
    if scale == "auto":
        return "study" if cuda else "cpu"
    if scale == "study" and not cuda:
        _fail("scale", scale, "the study scale needs a CUDA GPU and none is visible; use auto or cpu")
    return scale


def variant_accum_steps(params: dict[str, Any], variant: str, resolved_accum: int | None = None) -> int:
    """The accumulation steps a variant runs with: its own integer, or the top-level accum (resolved if auto)."""
    value = params["variants"][variant]["accum"]
    if value != "accum":
        return value
    if params["accum"] == "auto":
        if resolved_accum is None:
            raise ParamsError("params.yaml: accum = 'auto' needs the memory planner's result (the sweep stage)")
        return resolved_accum
    return params["accum"]


def set_values(p: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """`key.sub=value` assignments, values read as YAML (like `dvc exp run -S`); unknown keys rejected."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise ParamsError(f"{assignment!r}: expected KEY=VALUE, e.g. accum=8")
        *parents, last = key.split(".")
        node = p
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ParamsError(f"{key!r}: {part!r} is not a section of params.yaml")
            node = node[part]
        if last not in node:
            close = difflib.get_close_matches(last, list(node), n=1, cutoff=0.0)
            raise ParamsError(f"{key!r}: unknown key; did you mean {'.'.join([*parents, *close])!r}?")
        node[last] = yaml.safe_load(raw)
    return check(p)


if __name__ == "__main__":
    import argparse
    import sys

    from stages.outputs import write_text

    parser = argparse.ArgumentParser(description="check params.yaml, or write a copy with KEY=VALUE changes")
    parser.add_argument("file", type=Path, nargs="?", default=PARAMS_FILE)
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    try:
        values = set_values(load(args.file), args.set)
    except ParamsError as err:
        sys.exit(f"error: {err}")
    if args.set:
        write_text(args.file, yaml.safe_dump(values, sort_keys=False))
    print(f"{args.file}: valid")
