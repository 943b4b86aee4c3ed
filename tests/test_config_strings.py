"""fxacct.Config takes what the CLI's flags take: dtype and amp as short or torch names, input specs,
checkpoint patterns and optimizer options as strings, parsed by the same parsers the CLI uses; a value
of the wrong kind is a one-line UsageError naming the field (never an AttributeError from deep inside)."""

import pytest
import torch
from helpers import target

import fxacct
from fxacct.errors import UsageError

TWO_LAYER = target("examples/two_layer.py:TwoLayer")  # w1 3×3, w2 3×2: 15 parameters


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("torch.bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                         ("float32", torch.float32), ("fp8", torch.float8_e4m3fn)])
def test_dtype_takes_the_cli_names(name, dtype):
    assert fxacct.Config(dtype=name).dtype is dtype


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("float16", torch.float16)])
def test_amp_takes_the_cli_names(name, dtype):
    assert fxacct.Config(amp=name).amp is dtype


def test_a_string_dtype_profiles_as_the_torch_dtype():
    p = fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=2, dtype="bf16"))
    t = p.accounting.totals
    assert t.params == 3 * 3 + 3 * 2 == 15
    assert t.param_bytes == 15 * 2  # bf16: 2 bytes a parameter
    assert p.config.dtype is torch.bfloat16


@pytest.mark.parametrize("kwargs, words", [
    (dict(dtype="bf17"), "unknown dtype 'bf17'"),
    (dict(dtype=3), "Config(dtype=3)"),
    (dict(amp="fp32"), "--amp float32 is not an autocast dtype: use bf16 or fp16"),
    (dict(amp=torch.float32), "--amp float32 is not an autocast dtype"),
    (dict(batch="8"), "Config(batch='8'): give an integer"),
    (dict(inputs=[3]), "Config(inputs=(3,))"),
    (dict(inputs=["float32(B,3)"]), "malformed --input 'float32(B,3)'"),
    (dict(kwargs="d=1"), "Config(kwargs='d=1')"),
    (dict(optimizer="sgd", optim_args=["momentum"]), "--optim-arg"),
    # a switch given as a string read as on ('no' is truthy): each bool field takes True or False alone
    (dict(input_requires_grad="no"), "Config(input_requires_grad='no'): give True or False"),
    (dict(compile="no"), "Config(compile='no'): give True or False"),
    (dict(dedup=0), "Config(dedup=0): give True or False"),
    (dict(find_max_batch="no"), "Config(find_max_batch='no'): give True or False"),
    (dict(reshard_after_forward="no"), "Config(reshard_after_forward='no'): give True or False"),
    # names and specs of the wrong kind: AttributeErrors from deep inside, or an internal error
    (dict(mesh={"fsdp": 2}), "Config(mesh={'fsdp': 2}): give a string such as 'fsdp=8,tp=8'"),
    (dict(optimizer=torch.optim.SGD), "give a string such as 'adamw'"),
    (dict(gpu=100), "Config(gpu=100): give a string such as 'h100'"),
    (dict(checkpoint=3), "Config(checkpoint=3): give a string or a list of strings"),
    (dict(target=3), "Config(target=3): give a string"),
    (dict(target="hf:x", hf_class=3), "Config(hf_class=3): give a string"),
    (dict(mesh="fsdp=2", parallelize=3), "Config(parallelize=3): give a string"),
    (dict(checkpoint="h.*", checkpoint_policy=3), "Config(checkpoint_policy=3): give a string"),
    (dict(gpu="h100", mesh="fsdp=2", gpus_per_node=0), "--gpus-per-node must be at least 1, got 0"),
])
def test_a_wrong_value_is_one_usage_error_naming_it(kwargs, words):
    with pytest.raises(UsageError) as e:
        fxacct.Config(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_inputs_checkpoint_and_optimizer_options_as_strings():
    c = fxacct.Config(inputs=["x=float32[B,3]", "long[B,8]<10"], checkpoint="h.*", costs=["a.py"],
                      optimizer="sgd", optim_args=["momentum=0.9"])
    assert [str(s) for s in c.inputs] == ["x=float32[B,3]", "int64[B,8]<10"]
    assert c.inputs[0].shape(4) == (4, 3) and c.inputs[1].dtype is torch.int64
    assert c.checkpoint == ("h.*",) and c.costs == ("a.py",)  # one string is one pattern, not its characters
    assert c.optim_args == {"momentum": 0.9}


def test_string_inputs_profile_like_the_flag():
    p = fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=4, inputs="float32[B,3]"))
    # forward = 2·B·(D·H + H·K) = 2·4·(9 + 6) = 120 FLOPs (examples/two_layer.py)
    assert p.accounting.totals.forward.matmul == 120


def test_a_path_target_is_its_path_and_a_missing_one_is_named():
    """A pathlib.Path target profiles as its string (it raised AttributeError); no target at all
    is a usage error naming the two ways to give a model (it raised AttributeError on None)."""
    from pathlib import Path

    path = Path(TWO_LAYER.rpartition(":")[0])
    p = fxacct.profile(fxacct.Config(target=f"{path}:TwoLayer", batch=2))
    assert fxacct.Config(target=path).target == str(path)
    assert p.accounting.totals.forward.matmul == 60
    with pytest.raises(UsageError, match=r"Config\(target=None\): name the model.*fxacct.profile_module"):
        fxacct.profile(fxacct.Config())


def test_profile_module_takes_its_batch_from_the_inputs():
    """Without a Config the batch is the inputs' first dimension, so per-example figures are per
    example (it said batch 1 for inputs of 16); a Config whose batch is no dimension of any input is
    warned about (a sequence-first input, [T, B, D], has its batch second: no warning there).
    x @ w: [16, 8] @ [8, 2] = 2·16·8·2 = 512 FLOPs, 32 an example."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 2, bias=False)
    x = torch.empty(16, 8, device="meta")
    p = fxacct.profile_module(model, (x,))
    assert p.config.batch == 16 and p.accounting.totals.forward.matmul == 512 and not p.warnings
    given = fxacct.profile_module(model, (x,), config=fxacct.Config(batch=4))
    assert given.accounting.totals.forward.matmul == 512
    said, = [w for w in given.warnings if w.startswith("Config(batch=4)")]
    assert "float32[16,8]" in said and "Config(batch=N)" in said
    assert not fxacct.profile_module(model, (x,), config=fxacct.Config(batch=16)).warnings
    sequence_first = torch.empty(5, 3, 8, device="meta")  # [T, B, D]
    assert not fxacct.profile_module(model, (sequence_first,), config=fxacct.Config(batch=3)).warnings
