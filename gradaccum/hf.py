"""Hugging Face transformers as `hf:NAME`: built from a configuration under fake tensors (no weights, no download).

NAME is a folder holding a config.json, a config.json itself, one of KNOWN (published configurations shipped here),
or a model in the local Hugging Face cache (read offline). The model is made for its task (`TASKS`: from the
configuration unless --task says), in training mode with its configuration's dropout, and fed `seq_len` token ids
with its own loss (the labels its task takes; no padding, so no attention mask). `lora` wraps it in peft's LoRA of
that rank on peft's default target modules for the architecture (the attention projections), the base frozen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradaccum.sources import Source, Untraceable, token_ids


@dataclass(frozen=True)
class Known:
    """A published configuration: its architecture, the hyperparameters that differ from transformers' defaults
    for it, the task it was trained for, and where the numbers come from."""

    model_type: str
    settings: dict[str, Any] = field(default_factory=dict)
    task: str = "causal-lm"
    source: str = ""


KNOWN = {
    "bert-base-uncased": Known("bert", {}, "masked-lm", "Devlin et al. 2019, BERT-base (L=12, H=768, A=12); "
                               "google-bert/bert-base-uncased config.json, which is transformers' BertConfig default"),
    "bert-large-uncased": Known("bert", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                                         "intermediate_size": 4096}, "masked-lm",
                                "Devlin et al. 2019, BERT-large (L=24, H=1024, A=16); google-bert/bert-large-uncased "
                                "config.json"),
    "gpt2": Known("gpt2", {}, "causal-lm", "Radford et al. 2019, the 117M model (12 layers, d 768); "
                  "openai-community/gpt2 config.json, transformers' GPT2Config default"),
    "gpt2-medium": Known("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16}, "causal-lm",
                         "Radford et al. 2019, the 345M model (24 layers, d 1024); openai-community/gpt2-medium "
                         "config.json"),
    "t5-base": Known("t5", {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_decoder_layers": 12,
                            "num_heads": 12, "d_kv": 64, "vocab_size": 32128, "decoder_start_token_id": 0,
                            "pad_token_id": 0}, "seq2seq",
                     "Raffel et al. 2020, T5-Base (12+12 blocks, d_model 768, d_ff 3072); google-t5/t5-base "
                     "config.json"),
    "t5-small": Known("t5", {"decoder_start_token_id": 0, "pad_token_id": 0}, "seq2seq",
                      "Raffel et al. 2020, T5-Small (6+6 blocks, d_model 512, d_ff 2048); google-t5/t5-small "
                      "config.json, transformers' T5Config default"),
    "llama-3.2-1b": Known("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                    "tie_word_embeddings": True, "rope_theta": 500000.0,
                                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "head_dim": 64},
                          "causal-lm", "meta-llama/Llama-3.2-1B config.json (1.24B parameters)"),
    "tinyllama-1.1b": Known("llama", {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                                      "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                                      "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
                            "causal-lm", "Zhang et al. 2024, TinyLlama; TinyLlama/TinyLlama-1.1B-intermediate-"
                            "step-1431k-3T config.json"),
}  # fmt: skip


def config(name: str) -> tuple[Any, str]:
    """The configuration NAME names (hf: stripped), and where it came from; refused in one line if none."""
    import transformers

    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            settings = json.loads(path.read_text())
            return transformers.AutoConfig.for_model(settings.pop("model_type"), **settings), f"{path}"
        except (ValueError, KeyError) as err:
            raise Untraceable(f"hf:{name}: {path} is not a transformers config.json ({err})") from None
    if name in KNOWN:
        known = KNOWN[name]
        return transformers.AutoConfig.for_model(known.model_type, **known.settings), known.source
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True), "the local Hugging Face cache"
    except (OSError, ValueError):
        raise Untraceable(
            f"hf:{name}: not a folder with a config.json, a config.json, a model in the local Hugging Face cache "
            f"(read offline) or one of {', '.join(KNOWN)}"
        ) from None


ARCHITECTURE_TASKS = (("ForSequenceClassification", "seq-cls"), ("ForMaskedLM", "masked-lm"),
                      ("ForPreTraining", "masked-lm"), ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
                      ("ForConditionalGeneration", "seq2seq"))  # fmt: skip


def default_task(cfg: Any, name: str) -> str:
    """The task a configuration trains for: KNOWN's, else its `architectures`, else the first auto class that has
    its model type (encoder-decoder: seq2seq; an encoder such as BERT: masked-lm; else causal-lm)."""
    from transformers.models.auto import modeling_auto as auto

    if name in KNOWN:
        return KNOWN[name].task
    for arch in getattr(cfg, "architectures", None) or ():
        for suffix, task in ARCHITECTURE_TASKS:
            if arch.endswith(suffix):
                return task
    if getattr(cfg, "is_encoder_decoder", False):
        return "seq2seq"
    if cfg.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked-lm"
    return "causal-lm"


def auto_class(task: str) -> Any:
    import transformers

    return {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq-cls": transformers.AutoModelForSequenceClassification,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[task]


def hf_source(name: str, seq_len: int, task: str | None, attn: str | None, lora: int | None) -> Source:
    """`hf:NAME` as a Source: built for its task, fed `seq_len` token ids with the labels the task takes."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Untraceable(f"hf:{name}: needs transformers (pip install 'gradaccum[hf]')") from None
    cfg, where = config(name)
    task = task or default_task(cfg, name)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit and seq_len > limit and cfg.model_type not in ("t5",):  # T5's relative positions have no limit
        raise Untraceable(f"hf:{name}: --seq-len {seq_len} is longer than its {limit} positions")
    vocab = cfg.vocab_size

    def build(checkpointing: bool) -> nn.Module:
        kwargs = {"attn_implementation": attn} if attn else {}
        try:
            model = auto_class(task).from_config(cfg, **kwargs)
        except ValueError as err:
            raise Untraceable(f"hf:{name}: no {task} model for {cfg.model_type} ({str(err).splitlines()[0]})") from None
        model.train()
        if checkpointing:
            if not model.supports_gradient_checkpointing:
                raise Untraceable(f"hf:{name}: {type(model).__name__} has no gradient checkpointing")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model = with_lora(model, lora, name)
        return model

    def feed(model: nn.Module, micro: int, device: str) -> tuple[torch.Tensor, Any, Any]:
        ids = token_ids(micro, seq_len, vocab, device)
        if task == "seq-cls":
            labels = torch.empty(micro, dtype=torch.long, device=device).random_(cfg.num_labels)
        else:  # every position scored: the logits and their float32 copy are the same size as for a masked few
            labels = ids
        out = model(input_ids=ids, labels=labels)
        return out.loss, (ids, labels), out

    notes = [f"configuration: {where}", f"task {task}: {auto_class(task).__name__}"]
    notes += [f"LoRA rank {lora} (peft) on the default target modules, the base frozen"] if lora else []
    return Source(
        name=f"hf:{name}",
        build=build,
        input=f"{seq_len} token ids (vocab {vocab}), {task}",
        feed=feed,
        checkpointing="the model's gradient_checkpointing_enable (non-reentrant)",
        notes=tuple(notes),
    )


def with_lora(model: nn.Module, rank: int, name: str) -> nn.Module:
    """peft's LoRA of `rank`: trainable low-rank adapters beside the target projections, everything else frozen."""
    try:
        import peft
    except ImportError:
        raise Untraceable(f"hf:{name}: --lora needs peft (pip install 'gradaccum[hf]')") from None
    try:
        return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0))
    except ValueError as err:
        raise Untraceable(f"hf:{name}: --lora {rank}: {str(err).splitlines()[0]}") from None
