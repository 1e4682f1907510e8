"""What a person may choose when asking gradaccum-fit, named without importing torch: --help answers from these
before the heavy imports (gradaccum/cli.py). The modules that act on each choice import it from here, or are
held to it by tests/test_cli.py (spec.AMP_DTYPES, trace.OPTIMIZERS)."""

PINNED_TORCH = "2.14.1"  # the torch whose autocast lists and kernels the emulation was read from
AMP = ("float16", "bfloat16", "float32")  # float32: no autocast
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-loop", "adafactor")
INPUT_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_CARDS = (8.0, 12.0, 16.0, 24.0, 40.0, 80.0)
TASKS = ("causal-lm", "masked-lm", "seq-cls", "seq2seq")  # hf:NAME's tasks
ATTN = ("eager", "sdpa")  # hf:NAME's attention implementations
