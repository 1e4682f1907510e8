"""gradaccum-fit: will one training step of my model fit my GPU, and with which accum? No GPU needed.

    gradaccum-fit resnet50 --input 3x224x224 --num-classes 1000 --batch 256
    gradaccum-fit hf:bert-large-uncased --seq-len 512 --batch 32 --gpu a100-40gb
    gradaccum-fit hf:gpt2-medium --seq-len 1024 --batch 64 --checkpointing --cards 24
    gradaccum-fit hf:llama-3.2-1b --seq-len 2048 --batch 16 --lora 16 --amp bfloat16
    gradaccum-fit --model-fn mynet.py:build --input 3x256x256 --num-classes 21 --batch 64

Options are parsed, and refused by name, before torch is imported: --help answers at once. The step is traced on
fake tensors under CUDA's rules (gradaccum/fit.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from gradaccum import allocator, choices


def shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not CxHxW, e.g. 3x224x224")
    return int(parts[0]), int(parts[1]), int(parts[2])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradaccum-fit", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", help="a timm model name, torchvision:NAME or hf:NAME (or --model-fn)")
    p.add_argument(
        "--model-fn",
        metavar="FILE.py:FUNCTION",
        help="your own model: a function returning an nn.Module (or package.module:FUNCTION)",
    )
    p.add_argument("--loss-fn", metavar="FILE.py:FUNCTION", help="with --model-fn: loss(output, labels)")
    p.add_argument("--input", type=shape, default=(1, 28, 28), metavar="CxHxW", help="images (default 1x28x28)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--seq-len", type=int, help="token ids per sample (hf: default 512; --model-fn: feeds tokens)")
    p.add_argument("--vocab", type=int, help="with --model-fn and --seq-len: token ids are below it")
    p.add_argument("--task", choices=choices.TASKS, help="hf: the model's task (default: its configuration's)")
    p.add_argument("--attn", choices=choices.ATTN, help="hf: attention implementation (default: transformers' pick)")
    p.add_argument("--lora", type=int, metavar="R", help="hf: peft's LoRA of rank R, the base frozen")
    p.add_argument("--batch", type=int, default=256, help="the effective batch (samples per optimizer step)")
    p.add_argument("--accum", type=int, help="micro-batches per step (default: the smallest that fits each card)")
    p.add_argument("--amp", choices=choices.AMP, default="float16")
    p.add_argument("--optimizer", choices=choices.OPTIMIZERS, default="adamw")
    p.add_argument("--checkpointing", action="store_true", help="the model's activation checkpointing")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument(
        "--input-dtype",
        choices=choices.INPUT_DTYPES,
        default="float32",
        help="as images reach the GPU (default float32)",
    )
    p.add_argument(
        "--torch",
        dest="torch_version",
        default=choices.PINNED_TORCH,
        metavar="VERSION",
        help=f"the torch the step runs on, if older than {choices.PINNED_TORCH}: its version rules (docs/memory.md)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_const",
        const=True,
        help="the loop keeps its gradients allocated between steps: zero_grad(set_to_none=False), or none called",
    )
    p.add_argument(
        "--hold-output",
        action="store_true",
        help="the loop holds the model's output (logits) through backward: out = model(x); out.loss.backward()",
    )
    p.add_argument("--gpu", choices=list(allocator.GPUS), default="h100")
    p.add_argument("--cards", type=float, nargs="+", metavar="GB", help="default: the --gpu's size, or 8 to 80")
    p.add_argument("--margin", type=float, default=0.05, help="left free on every card (default 0.05)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    for name, value, ok in (
        ("--batch", args.batch, args.batch >= 1),
        ("--num-classes", args.num_classes, args.num_classes >= 1),
        ("--accum", args.accum, args.accum is None or 1 <= args.accum <= args.batch),
        ("--margin", args.margin, 0 <= args.margin < 1),
        ("--cards", args.cards, not args.cards or all(c > 0 for c in args.cards)),
        *((name, value, value is None or value >= 1) for name, value in
          (("--seq-len", args.seq_len), ("--vocab", args.vocab), ("--lora", args.lora))),  # fmt: skip
    ):
        if not ok:
            p.error(f"{name} {value} is not allowed: see --help")
    if bool(args.model) == bool(args.model_fn):
        p.error("give a model (timm name, torchvision:NAME or hf:NAME) or --model-fn FILE.py:FUNCTION, not both")
    hf = bool(args.model) and args.model.startswith("hf:")
    for name, value in (("--task", args.task), ("--attn", args.attn), ("--lora", args.lora)):
        if value is not None and not hf:
            p.error(f"{name} {value}: only for hf:NAME models")
    if args.loss_fn and not args.model_fn:
        p.error("--loss-fn: only with --model-fn")
    if args.model_fn and args.seq_len and not args.vocab:
        p.error("--model-fn with --seq-len needs --vocab (token ids are below it)")

    from gradaccum import autocast_policy, fit  # the heavy imports, after the options are known to be good
    from gradaccum.refusal import BadInput, refuse

    gpu = allocator.GPUS[args.gpu]
    given = argv if argv is not None else sys.argv
    cards = tuple(args.cards) if args.cards else ((gpu.memory_gib,) if "--gpu" in given else choices.DEFAULT_CARDS)
    q = fit.Question(
        model=args.model or args.model_fn,
        input=args.input,
        num_classes=args.num_classes,
        batch=args.batch,
        accum=args.accum,
        amp=args.amp,
        optimizer=args.optimizer,
        checkpointing=args.checkpointing,
        channels_last=args.channels_last,
        input_dtype=args.input_dtype,
        torch_version=args.torch_version,
        keep_grads=args.keep_grads,
        hold_output=args.hold_output,
        gpu=gpu,
        cards=cards,
        margin=args.margin,
        seq_len=args.seq_len,
        vocab=args.vocab,
        task=args.task,
        attn=args.attn,
        lora=args.lora,
        model_fn=args.model_fn,
        loss_fn=args.loss_fn,
    )
    try:
        autocast_policy.fp32_before(q.torch_version)
        a = fit.answer(q)
    except BadInput as err:
        refuse(err)
    print(json.dumps(a, indent=1) if args.json else fit.printout(a))


if __name__ == "__main__":
    main()
