"""The records stages hand on, one type each for the stage that writes and the ones that read: the machine
(data/hardware.json), the sweep's plan (reports/sweep/planner.json) and what one variant's run measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

FORMAT = 1  # the records' format: raised when a field changes meaning, so a reader never guesses at an old one
PLAN_FORMAT = 2  # the sweep's plan has a format of its own


def invalid(err: ValidationError) -> str:
    """Why a record was refused, in one line: the first field's path and what is wrong with it."""
    first = err.errors()[0]
    return f"{'.'.join(map(str, first['loc']))}: {first['msg'].lower()}"


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DidNotFit(Record):
    reason: str  # "out of memory: ..." or the planner's host-budget verdict
    memory_at_failure_mib: float
    device_total_mib: float


class SeedRun(Record):
    """Where one seed's run ended: what another seed gives is the yardstick for every difference in the report."""

    seed: int
    final_train_loss: float
    test_accuracy: float


class MemoryPeaks(Record):
    """The sampler's peaks (nvidia-smi on a GPU, RSS everywhere) and PyTorch's own counters on a GPU."""

    samples: int
    interval_ms: int
    rss_peak_mib: float  # the kernel's high-water mark of this process (VmHWM)
    sampled_rss_peak_mib: float | None = None
    nvidia_smi_peak_mib: float | None = None
    nvidia_smi_source: str | None = None  # process / gpu / torch: where the figure came from
    nvidia_smi_fallback: str | None = None  # what nvidia-smi printed instead of a figure, when it gave none
    gpu_total_mib: float | None = None
    sampled_torch_reserved_peak_mib: float | None = None
    torch_max_allocated_mib: float | None = None
    torch_max_reserved_mib: float | None = None
    sampler_errors: list[str] = []
    per_rank: list[MemoryPeaks] | None = None  # with several processes: each one's; the fields above are the max


class CudnnRun(Record):
    """The cuDNN flags a variant trained under (params `cudnn`); on a CPU none were set."""

    setting: Literal["default", "tutorial"] = "default"
    applied: bool = False
    enabled: bool | None = None
    deterministic: bool | None = None
    benchmark: bool | None = None
    note: str = ""


class Settings(BaseModel):
    """What a variant runs with, declared once: its run spec resolves these and its record repeats them."""

    variant: str
    norm: Literal["batch", "group"]
    weighting: Literal["exact", "divide"]
    epoch_end_step: bool
    swap: Literal["keep_act", "plain"]
    checkpointing: bool = False
    precision: Literal["default", "other"] = "default"
    accum: int
    accum_setting: int | str  # what params.yaml said: an integer, or "auto" resolved into accum
    micro_batch: int  # per process
    sync_batchnorm: bool = False
    batch: int  # samples per optimizer step, all processes together
    lr: float
    scale: Literal["study", "cpu"]
    device: Literal["cpu", "cuda"]
    amp: str


class VariantRecord(Record, Settings):
    """reports/variants/<variant>/metrics.json."""

    format: Literal[1]  # FORMAT
    cudnn: CudnnRun
    world_size: int = 1
    train_samples: int
    test_samples: int
    dataset: str = ""  # the data's provenance kind: mirror, local or fallback
    parameters: int
    # ran to the end; else did_not_fit or not_run says why (records before the rename call it fit)
    completed: bool = Field(validation_alias=AliasChoices("completed", "fit"))
    did_not_fit: DidNotFit | None = None
    not_run: str | None = None  # left out on purpose, before training (bfloat16 on a CPU that emulates it)
    final_train_loss: float | None = None
    test_accuracy: float | None = None
    images_per_second: float | None = None  # median over epochs, evaluation not timed
    optimizer_steps: int
    skipped_steps: int
    seeds: list[SeedRun] = []  # every seed's end point (params `seeds`); curves, speed and memory are the first's
    train_seconds: float  # the loop's own time over every seed, evaluation not included
    stage_seconds: float | None = None  # the whole train stage's process: start-up, imports, evaluation, writing
    memory: MemoryPeaks

    @model_validator(mode="after")
    def completed_means_no_failure(self) -> VariantRecord:
        if self.completed != (self.did_not_fit is None and self.not_run is None) or (self.did_not_fit and self.not_run):
            raise ValueError(
                f"completed = {self.completed} but did_not_fit = {self.did_not_fit}, not_run = {self.not_run}"
            )
        return self

    def why_not(self) -> str | None:
        """Why the variant did not train to the end, in a few words; None when it did."""
        if self.did_not_fit:
            return f"did not fit: {self.did_not_fit.reason}"
        return f"not run: {self.not_run}" if self.not_run else None

    @classmethod
    def read(cls, path: Path) -> VariantRecord:
        return cls.model_validate_json(Path(path).read_text())


DEVICES = {"study": "cuda", "cpu": "cpu"}  # where each scale trains: its dtype, its kernels, its autocast policy


class Facts(BaseModel):
    """A record another stage wrote, typed where the code reads it; the facts kept for readers pass through."""

    model_config = ConfigDict(extra="allow", frozen=True)


class Cpu(Facts):
    name: str
    cores: int | None = None
    native_bfloat16: bool  # oneDNN's bfloat16 kernels; without them bfloat16 is emulated, many times slower
    kernels: str | None = None  # ATen's instruction set (AVX512, AVX2, DEFAULT): which sums, in which order
    onednn_max_isa: str | None = None  # ONEDNN_MAX_CPU_ISA where it holds oneDNN below the CPU's best


class Gpu(Facts):
    name: str
    count: int
    memory_total_mib: float
    driver: str | None = None  # nvidia-smi's, where it answers
    cuda: str | None = None  # the CUDA version torch was built for


class Hardware(Facts):
    """data/hardware.json: the device and scale this checkout trains on."""

    format: Literal[1]  # FORMAT
    device: Literal["cpu", "cuda"]
    scale: Literal["study", "cpu"]
    cpu: Cpu
    gpu: Gpu | None = None

    @classmethod
    def nominal(cls, scale: str) -> Hardware:
        """The device a scale trains on, with every kernel it needs: for what is traced, not run (the trace)."""
        cpu = Cpu(name="any", native_bfloat16=True)
        return cls(format=FORMAT, device=DEVICES[scale], scale=scale, cpu=cpu)  # type: ignore[arg-type]


class Line(Facts):
    """Peak memory against the micro-batch (planner.predict_mib reads it): the measured points joined, the line's
    slope beyond them; a traced line has no points and is the line itself."""

    fixed_mib: float
    per_sample_mib: float
    r2: float = 1.0
    points: list[tuple[int, float]] = []


class Budget(Facts):
    what: str
    memory_mib: float
    safety_margin: float


class Plan(Facts):
    """reports/sweep/planner.json: the sweep's points, its lines and `accum: auto`, with and without checkpointing."""

    format: Literal[2]  # PLAN_FORMAT
    device: Literal["cpu", "cuda"]
    scale: Literal["study", "cpu"]
    batch: int
    measure: str  # what a point's peak is: nvidia-smi's figure on a GPU, RSS on the CPU
    line: Line
    line_checkpointing: Line
    points: list[dict[str, Any]]  # sweep.POINT_COLUMNS
    this_machine: Budget
    auto_accum: int | None
    auto_accum_checkpointing: int | None
    stage_seconds: float | None = None

    @property
    def lines(self) -> dict[bool, Line]:
        """Activation checkpointing off, on -> its line."""
        return {False: self.line, True: self.line_checkpointing}

    def auto(self, checkpointing: bool) -> int | None:
        return self.auto_accum_checkpointing if checkpointing else self.auto_accum
