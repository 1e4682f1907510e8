"""Models from every source: a user's function, torchvision's multi-head outputs, Hugging Face configurations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gradaccum import cli, fit, hf
from gradaccum.refusal import REFUSED

MIB = 2**20
# Each shipped configuration against the parameter count its model card or paper publishes (exact where the
# checkpoint's count is published to the parameter).
PUBLISHED_PARAMETERS = {
    "bert-base-uncased": (110e6, 0.01),  # "110M" (Devlin et al.), with the masked-LM head
    "bert-large-uncased": (335e6, 0.01),  # "340M" in the paper counts the pooler and NSP heads: 335M for MLM
    "gpt2": (124_439_808, 0),
    "gpt2-medium": (354_823_168, 0),
    "t5-small": (60_506_624, 0),
    "t5-base": (222_903_552, 0),
    "llama-3.2-1b": (1_235_814_400, 0),  # the model card's 1.23B; tied embeddings
    "tinyllama-1.1b": (1_100_048_384, 0),
}


@pytest.mark.parametrize("name", list(hf.KNOWN))
def test_each_shipped_configuration_has_its_published_size(name: str) -> None:
    assert set(PUBLISHED_PARAMETERS) == set(hf.KNOWN)
    with FakeTensorMode():
        model = hf.hf_source(name, 128, None, None, None).build(False)
        n = sum(p.numel() for p in model.parameters())
    published, rel = PUBLISHED_PARAMETERS[name]
    assert n == pytest.approx(published, rel=rel, abs=0)
    assert hf.KNOWN[name].source


E = 256  # the tiny GPT-2's width


def tiny_gpt2(folder: Path) -> Path:
    settings = {"model_type": "gpt2", "n_layer": 2, "n_embd": E, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(settings))
    return folder


def ask(model: str, **changes: object) -> dict:
    q = fit.Question(model=model, batch=4, accum=1, cards=(80.0,), seq_len=128, **changes)  # type: ignore[arg-type]
    return fit.answer(q)


def test_a_config_folder_traces_its_task_with_its_own_loss_and_attention(tmp_path: Path) -> None:
    a = ask(f"hf:{tiny_gpt2(tmp_path / 'tiny')}")
    params = 2 * (12 * E * E + 13 * E) + 1000 * E + 128 * E + 2 * E  # blocks, embeddings, final norm
    assert a["tensors_mib"]["weights"] == pytest.approx(params * 4 / MIB, abs=0.06)
    assert a["input"] == "128 token ids (vocab 1000), causal-lm"
    assert a["attention"]["kernels"] == {"flash": 2}  # dropout 0.1: not cuDNN's; causal, no mask: flash
    eager = ask(f"hf:{tmp_path / 'tiny'}", attn="eager")
    assert eager["attention"] is None and eager["tensors_mib"]["activations"] > a["tensors_mib"]["activations"]


def test_lora_keeps_no_gradient_or_optimizer_state_for_the_frozen_base(tmp_path: Path) -> None:
    tiny = tiny_gpt2(tmp_path / "tiny")
    full, lora = ask(f"hf:{tiny}"), ask(f"hf:{tiny}", lora=64)
    adapters = 2 * (E * 64 + 64 * 3 * E)  # peft's gpt2 default: c_attn, A (E x 64) and B (64 x 3E) per block
    assert lora["tensors_mib"]["optimizer state"] == pytest.approx(2 * adapters * 4 / MIB, abs=0.06)
    assert lora["tensors_mib"]["gradients"] <= adapters * 4 / MIB + 0.06
    assert full["tensors_mib"]["optimizer state"] == pytest.approx(2 * full["tensors_mib"]["weights"], rel=0.01)
    assert any("LoRA rank 64" in n for n in lora["notes"])


def test_checkpointing_is_the_models_own_and_keeps_less(tmp_path: Path) -> None:
    tiny = tiny_gpt2(tmp_path / "tiny")
    plain, ckpt = ask(f"hf:{tiny}"), ask(f"hf:{tiny}", checkpointing=True)
    assert ckpt["tensors_mib"]["activations"] < plain["tensors_mib"]["activations"]


USER = """
import torch
from torch import nn

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(3, 256, 3)
        self.head = nn.Linear(256, 1000)
    def forward(self, x):
        y = self.head(self.body(x).mean((2, 3)))
        return y, y.detach()  # a tuple: its first tensor is the logits

def build():
    return Two()

def lm():
    return nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100))

def not_a_module():
    return 3

def loss(output, labels):
    return output[0].float().logsumexp(1).mean()
"""


def test_a_users_own_module_is_fed_images_or_tokens(tmp_path: Path) -> None:
    user = tmp_path / "user.py"
    user.write_text(USER)
    images = fit.answer(fit.Question(model="user", model_fn=f"{user}:build", input=(3, 16, 16), num_classes=1000,
                                     batch=4, accum=1, cards=(8.0,)))  # fmt: skip
    assert images["tensors_mib"]["weights"] == pytest.approx(
        (3 * 9 * 256 + 256 + 256 * 1000 + 1000) * 4 / MIB, abs=0.06
    )
    own_loss = fit.answer(fit.Question(model="user", model_fn=f"{user}:build", loss_fn=f"{user}:loss",
                                       input=(3, 16, 16), batch=4, accum=1, cards=(8.0,)))  # fmt: skip
    assert own_loss["input"].endswith(f"loss {user}:loss")
    tokens = fit.answer(fit.Question(model="lm", model_fn=f"{user}:lm", seq_len=32, vocab=100, batch=4, accum=1,
                                     cards=(8.0,)))  # fmt: skip
    assert tokens["input"].startswith("token ids 32 long (vocab 100)")


def test_googlenets_auxiliary_heads_are_trained_as_its_recipe_trains_them() -> None:
    a = fit.answer(fit.Question(model="torchvision:googlenet", input=(3, 64, 64), num_classes=10, batch=2, accum=1,
                                cards=(8.0,)))  # fmt: skip
    assert "auxiliary heads" in a["notes"][0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-fn", "nowhere.py:build"], "--model-fn nowhere.py:build: no file nowhere.py"),
        (["--model-fn", "{user}:missing"], "has no function missing"),
        (["--model-fn", "{user}:not_a_module"], "returned int, not a torch.nn.Module"),
        (["--model-fn", "no_such_package_xyz.mod:f"], "importing no_such_package_xyz.mod failed"),
        (["hf:no-such-model-xyz"], "hf:no-such-model-xyz: not a folder with a config.json"),
        (["hf:gpt2", "--seq-len", "2048"], "hf:gpt2: --seq-len 2048 is longer than its 1024 positions"),
    ],
)
def test_a_model_that_cannot_be_had_is_refused_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = tmp_path / "user.py"
    user.write_text(USER)
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.format(user=user) for a in argv] + ["--batch", "2", "--cards", "8"])
    err = capsys.readouterr().err
    assert exit_.value.code == REFUSED and message in err and err.count("\n") == 1, err


def test_a_token_model_without_a_vocabulary_is_refused_before_anything_is_built() -> None:
    with pytest.raises(SystemExit):
        cli.main(["--model-fn", "x.py:f", "--seq-len", "8"])
    assert torch  # the module imports torch anyway; the refusal above came from the parser


@pytest.mark.parametrize("name", ["t5-base", "llama-3.2-1b"])
def test_an_encoder_decoder_and_a_grouped_query_decoder_trace_their_tasks(name: str) -> None:
    a = fit.answer(fit.Question(model=f"hf:{name}", seq_len=16, batch=1, accum=1, cards=(80.0,)))
    assert a["input"].endswith(hf.KNOWN[name].task) and a["attention"]["kernels"]
