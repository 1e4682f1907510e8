"""Where a question's model comes from: timm, torchvision, a user's own function, or Hugging Face transformers.

Each source gives a `Source`: how to build the model (called under fake tensors, so nothing is allocated), whether
it has an activation-checkpointing switch, and, for a model that does not take a batch of images and return logits
for cross-entropy, its `feed`: the loss of one micro-batch of its own input (gradaccum/trace.TracedStep.feed). A
model that cannot be had is refused in one line naming it and the reason (`Untraceable`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.refusal import BadInput

# (model, micro-batch, device) -> the loss, the batch the loop holds until backward is done, the model's output
Feed = Callable[[nn.Module, int, str], tuple[torch.Tensor, Any, Any]]
# Training outputs with auxiliary heads, and the weights their papers' recipes give those heads' losses (the memory
# is the same whatever the weight: autograd keeps every head's activations): GoogLeNet (Szegedy et al. 2015, "the
# losses of the auxiliary classifiers were weighted by 0.3"), Inception v3 (PyTorch's fine-tuning tutorial and the
# paper's recipe: 0.4).
AUX_WEIGHTS = {"GoogLeNetOutputs": ("logits", {"aux_logits1": 0.3, "aux_logits2": 0.3}),
               "InceptionOutputs": ("logits", {"aux_logits": 0.4})}  # fmt: skip
AUX_ARCHS = ("googlenet", "inception_v3")  # the torchvision models whose training output is one of those


class Untraceable(BadInput):
    """A model that cannot be built or traced: refused in one line that names it and says why."""


def first_tensor(output: Any) -> torch.Tensor:
    """The logits of a training output: a tensor itself, else the first tensor of a tuple, list, dict or dataclass."""
    if isinstance(output, torch.Tensor):
        return output
    if dataclasses.is_dataclass(output):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    if isinstance(output, dict):
        output = list(output.values())
    for value in output if isinstance(output, (tuple, list)) else ():
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"the model returned {type(output).__name__}, in which there is no tensor")


def recipe_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classifier's training output against `labels`, with its auxiliary heads' losses added
    where its recipe adds them (AUX_WEIGHTS); otherwise the output's first tensor."""
    if type(output).__name__ in AUX_WEIGHTS:
        main, aux = AUX_WEIGHTS[type(output).__name__]
        loss = F.cross_entropy(getattr(output, main), labels)
        for field, weight in aux.items():
            if getattr(output, field, None) is not None:
                loss = loss + weight * F.cross_entropy(getattr(output, field), labels)
        return loss
    return F.cross_entropy(first_tensor(output), labels)


@dataclass(frozen=True, kw_only=True)
class Source:
    """A model to trace: `build(checkpointing)` makes it; `feed` is its loss on one micro-batch of its own input
    (None: a batch of images, the trace's own, scored by `loss(output, labels)`); `input` says what it is fed."""

    name: str
    build: Callable[[bool], nn.Module]
    input: str
    feed: Feed | None = None
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = recipe_loss
    checkpointing: str | None = None  # how it checkpoints; None: it has no switch
    notes: tuple[str, ...] = ()


def image_source(name: str, input: tuple[int, int, int], num_classes: int) -> Source:
    """A timm model, or torchvision:NAME, untrained (no download), for `input`-shaped images and `num_classes`."""
    shape = "x".join(map(str, input))
    if name.startswith("torchvision:"):
        import torchvision

        arch = name.removeprefix("torchvision:")
        known = torchvision.models.list_models()
        if arch not in known:
            close = difflib.get_close_matches(arch, known, n=3)
            raise Untraceable(f"{name}: not a torchvision model; close: {', '.join(close) or 'none'}")
        if input[0] != 3:
            raise Untraceable(f"{name}: torchvision's models take 3 input channels, not --input {shape}")

        def build_tv(checkpointing: bool) -> nn.Module:
            if checkpointing:
                raise Untraceable(f"{name}: --checkpointing needs timm's set_grad_checkpointing; torchvision has none")
            return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)

        notes = (f"training loss: the main head's and its auxiliary heads' ({arch})",) if arch in AUX_ARCHS else ()
        return Source(name=name, build=build_tv, input=f"images {shape}, {num_classes} classes", notes=notes)
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        raise Untraceable(f"{name}: not a timm model (or torchvision:NAME); close: {', '.join(close) or 'none'}")

    def build(checkpointing: bool) -> nn.Module:
        kwargs: dict[str, Any] = {"pretrained": False, "in_chans": input[0], "num_classes": num_classes}
        with contextlib.suppress(TypeError):  # a model of fixed input size (ViT) takes the input's
            model = timm.create_model(name, img_size=input[1:], **kwargs)
            return grad_checkpointing(model, name) if checkpointing else model
        model = timm.create_model(name, **kwargs)
        return grad_checkpointing(model, name) if checkpointing else model

    return Source(
        name=name,
        build=build,
        input=f"images {shape}, {num_classes} classes",
        checkpointing="timm's set_grad_checkpointing",
    )


def grad_checkpointing(model: nn.Module, name: str) -> nn.Module:
    try:
        model.set_grad_checkpointing(True)
    except (AssertionError, NotImplementedError) as err:
        raise Untraceable(
            f"{name}: timm has no activation checkpointing for it ({err or type(err).__name__})"
        ) from None
    return model


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """FILE.py:FUNCTION or package.module:FUNCTION, imported; refused in one line naming `option` if it cannot be."""
    where, sep, function = spec.rpartition(":")
    if not sep or not where or not function.isidentifier():
        raise Untraceable(f"{option} {spec}: not FILE.py:FUNCTION or package.module:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise Untraceable(f"{option} {spec}: no file {where}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec and module_spec.loader
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Untraceable:
        raise
    except Exception as err:
        raise Untraceable(f"{option} {spec}: importing {where} failed ({type(err).__name__}: {err})") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise Untraceable(f"{option} {spec}: {where} has no function {function}")
    return found


def token_ids(micro: int, seq_len: int, vocab: int, device: str) -> torch.Tensor:
    return torch.empty(micro, seq_len, dtype=torch.long, device=device).random_(vocab)


def function_source(
    spec: str,
    input: tuple[int, int, int],
    num_classes: int,
    seq_len: int | None,
    vocab: int | None,
    loss_spec: str | None,
) -> Source:
    """A user's function returning an nn.Module, fed images of `input`'s shape as the trace feeds any classifier
    (labels of `num_classes`) or, with `seq_len`, token ids below `vocab` (labels: the ids themselves, one per
    position). The loss is `loss_spec`'s function of (output, labels), else cross-entropy over the output's logits
    (recipe_loss; a token model's logits [batch, positions, vocab])."""
    make = load_function(spec, "--model-fn")
    loss_fn = load_function(loss_spec, "--loss-fn") if loss_spec else None

    def build(checkpointing: bool) -> nn.Module:
        model = make()
        if not isinstance(model, nn.Module):
            raise Untraceable(f"--model-fn {spec}: returned {type(model).__name__}, not a torch.nn.Module")
        if checkpointing:
            if hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable()
            elif hasattr(model, "set_grad_checkpointing"):
                model.set_grad_checkpointing(True)
            else:
                raise Untraceable(
                    f"--model-fn {spec}: --checkpointing needs a gradient_checkpointing_enable() or "
                    "set_grad_checkpointing() method on the module"
                )
        return model

    def tokens(model: nn.Module, micro: int, device: str) -> tuple[torch.Tensor, Any, Any]:
        x = token_ids(micro, seq_len or 1, vocab or 1, device)
        output = model(x)
        if loss_fn:
            return loss_fn(output, x), x, output
        logits = first_tensor(output)
        return F.cross_entropy(logits.flatten(0, -2), x.flatten()), x, output

    fed = f"token ids {seq_len} long (vocab {vocab})" if seq_len else f"images {'x'.join(map(str, input))}"
    return Source(
        name=spec,
        build=build,
        input=fed + (f", loss {loss_spec}" if loss_spec else ", cross-entropy"),
        feed=tokens if seq_len else None,
        loss=loss_fn or recipe_loss,
        checkpointing="the module's own switch",
    )
