"""Peak memory of a training step, traced without allocating any: what a GPU would hold, on any machine.

Under FakeTensorMode a tensor has a shape, a dtype and a device but no storage, so a step of the
tutorial's baseline (batch 32,768) traces in seconds on a laptop. PyTorch's MemTracker (a private API of
torch.distributed._tools, pinned by tests/test_trace.py) sees every tensor the step creates and sorts the
bytes live at the peak into parameters, buffers, gradients, optimizer state, activations and
temporaries. Should it break, a TorchDispatchMode that adds up output storages would do the same job.

What the trace cannot see, a GPU adds: the CUDA context, cuDNN and cuBLAS workspaces (allocated outside
PyTorch's dispatcher) and the caching allocator's rounding and slack; nvidia-smi shows all of them.
Fake CUDA tensors need a driver for backward ("hasPrimaryContext expects a valid device index"), so the
trace runs on fake CPU tensors, under autocast with the dtype the GPU run uses and, for the study (GPU)
scale, CUDA's autocast policy (gradaccum/autocast_policy.py: GroupNorm in float32, as a GPU runs it). The
CPU scale keeps the CPU's policy: it is checked against the CPU's real allocator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from timm.layers import is_fast_norm, set_fast_norm
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum import allocator, autocast_policy
from gradaccum.attention import CudaKernels
from gradaccum.loop import make_optimizer, normalize
from gradaccum.memory import MIB
from gradaccum.models import IMAGE_SIZE, spec_model
from gradaccum.params import Params
from gradaccum.records import Hardware, Line
from gradaccum.sources import recipe_loss
from gradaccum.spec import AutoUndecided, RunSpec, resolve

TRACKER_KINDS = {  # MemTracker's names for what holds memory -> ours
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "data",
}


class _NoHook:
    def remove(self) -> None:
        pass


NO_HOOK = _NoHook()


class PeakTracker(MemTracker):
    """MemTracker keeping the whole step's peak only: its per-module peaks, updated on every operation for
    every module (about 250 here), made a trace 4x slower (3.5 s against 0.9 s an efficientnet_b0 step).

    It also keeps every storage's allocation and free in order (`events`), for the caching allocator's
    model to replay (gradaccum/allocator.py): MemTracker sees each storage once when it is made and once
    when it dies.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, object, int]] = []

    def _update_snap(self, u_type: _UpdateType, winfo: Any, *args: Any, **kwargs: Any) -> None:
        if u_type in (_UpdateType.DEL, _UpdateType.SIZE):
            self.events.append(("free", winfo, 0))
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if u_type in (_UpdateType.ADD, _UpdateType.SIZE):
            self.events.append(("malloc", winfo, winfo.mem_consumed))

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses: give those a
        handle that removes nothing, so it skips them."""
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (NO_HOOK, NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {  # what a step's optimizer keeps: none, one or two
    "adamw": partial(make_optimizer, lr=1e-3),  # the study's: two moments per parameter
    "adam": lambda model, foreach: torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach),
    "sgd": lambda model, foreach: torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach),
    "sgd-momentum": lambda model, foreach: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach),
    # AdamW one parameter at a time on any device (foreach=False): as transformers' own AdamW, the Trainer's default
    # before `adamw_torch`, stepped, holding one parameter's temporaries, not a list of them
    "adamw-loop": lambda model, foreach: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                                           foreach=False),  # fmt: skip
    # torch's Adafactor: a matrix keeps a row and a column of its second moment, a vector the whole; no first moment
    "adafactor": lambda model, foreach: torch.optim.Adafactor(model.parameters(), foreach=foreach),
}


class ValuesReadAsOne(TorchDispatchMode):
    """A fake tensor read as a Python number (`.item()`) is read as 1.0. Adafactor's step reads norms so, to scale
    its update by a scalar; on fake tensors there is no value, and the value decides that scalar, not which tensors
    the step makes, so any value traces the same allocations. Real tensors are read as they are."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1.0
        return func(*args, **(kwargs or {}))


def steady_optimizer(
    model: nn.Module, accum: int, policy: str = autocast_policy.CPU, kind: str = "adamw", set_to_none: bool = True
) -> torch.optim.Optimizer:
    """The optimizer as every micro-batch after the first step finds it: its state made (AdamW's two moments, SGD's
    momentum), and with accum > 1 the window's gradients held (accum 1 frees them after each step:
    zero_grad(set_to_none=True), unless an older torch's zero_grad kept them).

    Under CUDA's rules, the foreach implementation, PyTorch's default for CUDA parameters: its step holds
    whole lists of parameter-sized temporaries, where the CPU's default (which fake CPU tensors would get)
    holds one tensor's at a time."""
    opt = OPTIMIZERS[kind](model, foreach=True if policy == autocast_policy.CUDA else None)  # native: CUDA's
    for p in model.parameters():
        if p.requires_grad:  # a frozen weight (LoRA's base) gets no gradient and no optimizer state
            p.grad = torch.zeros_like(p)
    with ValuesReadAsOne():
        opt.step()
    if accum == 1:
        opt.zero_grad(set_to_none=set_to_none)
    return opt


@dataclass(frozen=True, kw_only=True)
class TracedStep:
    """One training step to trace: the model, the micro-batch and window it runs at, its classes, the autocast
    dtype, and what the input is.

    The study's input (`arrives="uint8"`): 28x28 digits indexed from a uint8 dataset of which `resident` images stay
    on the device, normalised there. A DataLoader's (`arrives="float32"`, or "float16"/"bfloat16" for a loop that
    casts the batch as it copies it, `.to(device, dtype)`): a normalised batch of `input`'s shape, copied to the
    device each step, nothing resident. `torch_version` is the torch whose defaults the step follows, for a
    measurement made on an older one: its CUDA autocast lists (autocast_policy.cuda_policy) and its zero_grad.
    `feed`, for a model that is not the study's image classifier (a transformer, a user's own): the model's loss on
    one micro-batch of its own input, made inside, and that batch, which the loop holds until backward is done
    (gradaccum/sources.py); `input` and `num_classes` then go unused.
    """

    build: Callable[[], nn.Module]
    micro: int
    accum: int
    num_classes: int
    dtype: torch.dtype | None
    resident: int = 0
    input: tuple[int, int, int] = (1, IMAGE_SIZE, IMAGE_SIZE)
    arrives: str = "uint8"
    optimizer: str = "adamw"
    channels_last: bool = False
    torch_version: str = autocast_policy.PINNED_TORCH
    feed: Callable[[nn.Module, int, str], tuple[torch.Tensor, Any, Any]] | None = None
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = recipe_loss  # of the images' output and labels
    keep_grads: bool | None = None  # the loop keeps its gradients allocated between steps; None: torch's default
    hold_output: bool = False  # the loop keeps the model's output (its logits) until backward is done

    @property
    def set_to_none(self) -> bool:
        """Whether the step's zero_grad frees the gradients. torch's default: from 2.0 it does; before, it zeroed
        them and kept them allocated through the next forward and backward (pytorch/pytorch#92731). A loop that
        calls zero_grad(set_to_none=False), or never frees them, keeps them whatever the torch (`keep_grads`)."""
        if self.keep_grads is not None:
            return not self.keep_grads
        return autocast_policy.release(self.torch_version) >= (2, 0)

    @classmethod
    def of(cls, spec: RunSpec, fast_norm: bool = False) -> TracedStep:
        """The spec's step as its device trains it, its data resident; `fast_norm` with timm's fast norm."""
        build = partial(spec_model, spec)
        return cls(
            build=with_fast_norm(build) if fast_norm else build,
            micro=spec.micro_batch,
            accum=spec.accum,
            num_classes=spec.model.num_classes,
            dtype=spec.dtype,
            resident=spec.train_samples + spec.test_samples,
        )

    def made(self, policy: str = autocast_policy.CPU, device: str = "cpu") -> tuple[nn.Module, Any, torch.Tensor]:
        """What is live before the step: the model, its steady optimizer, the resident data."""
        model = self.build()
        for p in model.parameters() if self.channels_last else []:  # what model.to(channels_last) does, which
            if p.dim() == 4:  # cannot swap a fake module's parameters
                p.data = p.data.contiguous(memory_format=torch.channels_last)
        data = torch.empty(self.resident, *self.input[1:], dtype=torch.uint8, device=device)
        return model, steady_optimizer(model, self.accum, policy, self.optimizer, self.set_to_none), data

    def images(self, device: str = "cpu") -> torch.Tensor:
        """One micro-batch as it reaches the device: indexed from the uint8 dataset, or a DataLoader's batch."""
        if self.arrives == "uint8":
            return torch.empty(self.micro, *self.input[1:], dtype=torch.uint8, device=device)
        images = torch.empty(self.micro, *self.input, dtype=getattr(torch, self.arrives), device=device)
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def image_loss(self, model: nn.Module, device: str) -> tuple[torch.Tensor, Any, Any]:
        """The classifier on one micro-batch of images: `loss` against random labels (by default cross-entropy, with
        auxiliary heads' losses where its recipe adds them: sources.recipe_loss)."""
        images = self.images(device)
        labels = torch.empty(self.micro, dtype=torch.long, device=device).random_(self.num_classes)
        logits = model(normalize(images) if self.arrives == "uint8" else images)
        return self.loss(logits, labels), (images, labels), logits

    def run(self, model: nn.Module, opt: torch.optim.Optimizer, device: str = "cpu") -> None:
        """One micro-batch's forward and backward as the loop runs it, then the optimizer step that ends a window.

        The loop's loss weighting and GradScaler hold no tensors of any size (the scaler unscales in place),
        so the peak is this one's.
        """
        with torch.autocast(device, dtype=self.dtype, enabled=self.dtype is not None):
            loss, batch, output = self.feed(model, self.micro, device) if self.feed else self.image_loss(model, device)
        # `out = model(x); out.loss.backward()` holds the output (a transformer's logits) through backward; a loop
        # that keeps only the loss, as the Trainer's compute_loss does, lets it go first
        held = (batch, output) if self.hold_output else batch
        del batch, output
        loss.backward()
        del loss, held
        with ValuesReadAsOne():
            opt.step()
        opt.zero_grad(set_to_none=self.set_to_none)


def trace_step(
    s: TracedStep, policy: str = autocast_policy.CPU, gpu: allocator.Gpu = allocator.STUDY_GPU, cards_mib: tuple = ()
) -> dict[str, Any]:
    """MiB live at the peak of a steady-state step on fake tensors, in total and by kind, and whose rules cast it.

    `policy` is whose autocast rules cast each op ("cuda" or "cpu"): a GPU figure needs CUDA's, and with them
    comes what CUDA's caching allocator would make of the same allocations (gradaccum/allocator.py): its
    allocated and reserved peaks and the nvidia-smi figure they predict; and for each usable size in `cards_mib`,
    the same allocations replayed on a card of that size (`gpu_cards`: allocator.on_card). Under CUDA's rules each
    scaled_dot_product_attention runs the kernel `gpu`'s CUDA would pick (gradaccum/attention.py); the row's
    `attention` names them.
    """
    cuda = policy == autocast_policy.CUDA
    rules = autocast_policy.cuda_policy(s.torch_version) if cuda else contextlib.nullcontext()
    attention = CudaKernels(gpu) if cuda else contextlib.nullcontext()
    device = "cuda" if policy == autocast_policy.NATIVE_CUDA else "cpu"  # fake CUDA tensors need a driver
    with rules as difference, attention, FakeTensorMode(), torch.device(device), warnings.catch_warnings():
        # ModTracker warns when a module's weak reference is gone by its backward hook (a peft wrapper's): harmless
        warnings.filterwarnings("ignore", "Module is None", UserWarning)
        model, opt, data = s.made(policy, device)
        tracker = PeakTracker()
        tracker.track_external(model, opt, data)
        with tracker:
            start = len(tracker.events)  # what was there before the step: weights, optimizer state, data
            s.run(model, opt, device)
            events = list(tracker.events)
        (peak,) = tracker.get_tracker_snapshot("peak").values()  # one device
    kinds = {ours: peak.get(theirs, 0) / MIB for theirs, ours in TRACKER_KINDS.items()}
    row: dict[str, Any] = {"peak_mib": sum(kinds.values()), **{f"{k}_mib": v for k, v in kinds.items()}}
    row["autocast_policy"] = policy_name(policy, s.dtype, difference, s.torch_version)
    if isinstance(attention, CudaKernels) and attention.chosen:
        row["attention"] = attention.summary()
    if policy in (autocast_policy.CUDA, autocast_policy.NATIVE_CUDA):
        row |= allocator.predict_gpu(events[:start], events[start:], gpu=gpu)
        if cards_mib:
            row["gpu_cards"] = [allocator.on_card(events[:start], events[start:], u, gpu=gpu) for u in cards_mib]
    return row


def allocated_peak_mib(s: TracedStep) -> float:
    """The same step on real CPU tensors: the peak of what PyTorch's CPU allocator handed out, from the
    profiler's record of every allocation and free (kernels' own workspaces included, which a trace misses)."""
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with quiet_native_stderr(), profile as prof:
        model, opt, data = s.made()
        s.run(model, opt)
        del model, opt, data
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak / MIB


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """The profiler's C++ side prints two log lines a run (and a CUDA build without a GPU an error) to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def with_fast_norm(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build` with timm's fast norm on (timm.layers.set_fast_norm): its GroupNormAct layers, which read the
    switch when made, run GroupNorm in the autocast dtype instead of the float32 CUDA's autocast gives it.
    nn.GroupNorm (the tutorial's plain swap) ignores it."""

    def make() -> nn.Module:
        before = is_fast_norm()
        set_fast_norm(True)
        try:
            return build()
        finally:
            set_fast_norm(before)

    return make


def traced_spec(p: Params, variant: str, scale: str, accum: int | None = None) -> RunSpec | None:
    """The variant's spec as its scale's device would run it; None where accum: auto leaves the step undecided."""
    try:
        return resolve(p, variant, Hardware.nominal(scale), accum=accum)
    except AutoUndecided:
        return None


def trace_variant(
    p: Params,
    variant: str,
    scale: str,
    allocated: bool = False,
    accum: int | None = None,
    fast_norm: bool = False,
    native: bool = False,
) -> dict[str, Any]:
    """The traced peak of one variant at one scale, with its breakdown; `allocated` adds the real CPU run's;
    `accum` traces it at that many micro-batches instead of its own; `fast_norm` with timm's fast norm; `native`
    (the study scale, on a machine with a CUDA driver) under CUDA's own autocast instead of its emulation."""
    row: dict[str, Any] = {"variant": variant, "scale": scale}
    spec = traced_spec(p, variant, scale, accum)
    if spec is None:
        return row | {"note": "accum: auto is decided on the device that runs it; see python -m gradaccum.cards"}
    s = TracedStep.of(spec, fast_norm)
    row |= {"accum": spec.accum, "micro_batch": spec.micro_batch, "amp": spec.amp}
    row |= {"fast_norm": True} if fast_norm else {}
    row |= trace_step(s, policy=autocast_policy.NATIVE_CUDA if native else autocast_policy.of_device(spec.device))
    if allocated:
        row["allocated_peak_mib"] = allocated_peak_mib(s)
    return row


def policy_name(
    device_type: str,
    dtype: torch.dtype | None,
    difference: autocast_policy.Difference | None = None,
    torch_version: str = autocast_policy.PINNED_TORCH,
) -> str:
    """Whose autocast rules a trace followed, as its row records it; on a torch whose CUDA lists differ from the
    pinned ones (none of the differing ops called, or the trace would have stopped), the difference too."""
    if dtype is None:
        return "none (float32, no autocast)"
    if device_type == autocast_policy.NATIVE_CUDA:
        return f"CUDA's own (torch {torch.__version__}, fake CUDA tensors on this machine's driver)"
    if device_type == autocast_policy.CUDA:
        emulated = f"CUDA's (torch {autocast_policy.PINNED_TORCH} lists, emulated on the CPU)"
        if older := autocast_policy.older_rules(torch_version):
            emulated = (
                f"CUDA's as of torch {torch_version}, as far as modelled (torch {autocast_policy.PINNED_TORCH}'s "
                f"lists; {older}; emulated on the CPU)"
            )
        return emulated + (f"; {difference}, and this step calls none of those ops" if difference else "")
    return "the CPU's"


def peak_line(micros: tuple[int, int], rows: tuple[dict[str, Any], dict[str, Any]]) -> Line:
    """The traced peak as a line in the micro-batch through two traced sizes (`figure` of each: under CUDA's
    rules the predicted nvidia-smi figure, tensors, the allocator's cache and the context).

    The peak is the larger of the optimizer step's (flat) and backward's (growing exactly with the batch):
    two sizes where backward sets it give the line exactly, and a chord across both parts lies above the
    peak between them. Traced with a window's gradients held (accum > 1), the larger of the two steady
    states, so a suggested accum never falls short.
    """
    low, high = (figure(r) for r in rows)
    per_sample = (high - low) / (micros[1] - micros[0])
    return Line(fixed_mib=low - per_sample * micros[0], per_sample_mib=per_sample)


def figure(row: dict[str, float]) -> float:
    """The MiB a card must hold for a traced step: nvidia-smi's predicted figure where the step was traced
    under CUDA's rules (a GPU), the live tensors' peak elsewhere."""
    return row.get("gpu_nvidia_smi_mib", row["peak_mib"])
