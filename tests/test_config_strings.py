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
