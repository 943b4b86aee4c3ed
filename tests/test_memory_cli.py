"""The memory flags of `fxacct profile` through the CLI: bad values are one-line usage errors
(exit 2, nothing on stdout, no traceback), and a --gpu profile says whether it fits and the
largest batch that does.
"""

from __future__ import annotations

import re
import sys

import pytest
from click.testing import CliRunner
from helpers import target

from fxacct_cli.main import cli

TWO_LAYER = target("examples/two_layer.py:TwoLayer")
SMALL_GPT = [target("examples/gpt2.py:GPT"), "-k", "n_layer=2", "-k", "n_head=4", "-k", "n_embd=64",
             "-k", "vocab_size=100", "-k", "block_size=32"]


def invoke(*args: str):
    try:  # click < 8.2 mixes stderr into output unless told not to
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2: stderr is always captured separately
        runner = CliRunner()
    return runner.invoke(cli, ["profile", *args], catch_exceptions=False)


def shown(result) -> str:
    return f"exit code {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def assert_usage_error(result, *fragments: str) -> str:
    msg = shown(result)
    assert result.exit_code == 2, msg
    assert "Traceback" not in result.stdout + result.stderr, msg
    assert result.stdout == "", msg
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), msg
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, msg)
    return lines[0]


BAD = [
    ("unknown-optimizer", ["--optimizer", "nosuch"], ["'nosuch'", "adamw"]),
    ("optim-arg-no-equals", ["--optim-arg", "momentum"], ["--optim-arg", "'momentum'", "NAME=VALUE"]),
    ("optim-arg-not-a-literal", ["--optim-arg", "momentum=abc"], ["--optim-arg", "'abc'"]),
    ("optim-arg-unknown-name", ["--optim-arg", "nosuch=1"], ["nosuch", "AdamW", "weight_decay"]),
    ("optim-arg-rejected-by-the-class", ["--optimizer", "sgd", "--optim-arg", "lr=-1"], ["SGD", "lr"]),
    ("shard-without-world-size", ["--shard", "zero3"], ["--shard zero3", "--world-size"]),
    ("unknown-shard", ["--shard", "zero9", "--world-size", "2"], ["'zero9'", "zero3"]),
    ("world-size-zero", ["--world-size", "0"], ["--world-size", "0"]),
    ("unknown-gpu", ["--gpu", "nosuch"], ["--gpu", "'nosuch'", "h100"]),
    ("amp-fp32", ["--amp", "fp32"], ["--amp", "bf16"]),
    ("amp-with-dtype", ["--amp", "bf16", "--dtype", "bf16"], ["--amp", "--dtype"]),
    ("master-weights-without-dtype", ["--master-weights"], ["--master-weights", "--dtype bf16"]),
    ("master-weights-with-fp32", ["--master-weights", "--dtype", "fp32"], ["--master-weights", "--dtype bf16"]),
]


@pytest.mark.parametrize("args, fragments", [pytest.param(a, f, id=i) for i, a, f in BAD])
def test_bad_memory_flag_is_one_usage_error_line(args, fragments):
    assert_usage_error(invoke(TWO_LAYER, *args), *fragments)


# Adam's constructor does not check the length of `betas`; its first step indexes betas[1]. fxacct
# builds the optimizer (fxacct/trace/optim_step.py OptimizerSpec.build catches only the constructor's errors)
# and steps it inside capture (regression: the IndexError once became a ModelError, exit 3).
def test_bad_optimizer_option_value_is_a_usage_error():
    assert_usage_error(invoke(TWO_LAYER, "--optimizer", "adam", "--optim-arg", "betas=(0.9,)"), "betas")


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "memory.png"
    assert_usage_error(invoke(TWO_LAYER, "--plot", str(out)), "--plot", "matplotlib", "pip install")
    assert not out.exists()


def test_gpu_profile_prints_the_fit_and_the_largest_batch():
    result = invoke(*SMALL_GPT, "--gpu", "h100")
    assert result.exit_code == 0, shown(result)
    text = result.stdout
    # H100 80GB: the driver reports 81,559 MiB = 79.65 GiB
    fit = [ln for ln in text.splitlines() if "H100" in ln and "79.65 GiB" in ln and "per-rank peak" in ln]
    assert len(fit) == 1, text
    # on a CUDA target the fit holds what the caching allocator reserves plus the fixed costs outside it
    assert re.search(r"per-rank peak reserved \+ fixed [0-9.]+ [KMGT]iB, fits, [0-9.]+ [KMGT]iB headroom", fit[0]), fit[0]
    largest = [ln for ln in text.splitlines() if ln.startswith("largest batch that fits: ")]
    assert len(largest) == 1, text
    assert int(re.match(r"largest batch that fits: ([0-9]+)", largest[0]).group(1)) > 1


def test_sharded_profile_prints_the_per_rank_line():
    result = invoke(target("examples/mlp.py:MLP"), "-k", "d_model=32", "-k", "d_hidden=64", "-k", "n_blocks=2",
                    "--optimizer", "adam", "--amp", "bf16", "--world-size", "8", "--shard", "zero3")
    assert result.exit_code == 0, shown(result)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("per rank, zero3 over 8 ranks")), None)
    assert line is not None, result.stdout
    assert "gathered unit blocks.0" in line, line
