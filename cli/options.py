"""Options shared by every command that loads a model, defined once, and their conversion
to a Config."""

from __future__ import annotations

import json

import click

from fxacct.load.config import CAUSAL_CONVENTIONS, Config
from fxacct.dtypes import parse_dtype
from fxacct.errors import UsageError
from fxacct.load.inputs import parse_input_spec
from fxacct.load.model_spec import parse_kwarg
from fxacct.trace.optim_step import parse_optim_arg

MODEL_OPTIONS = (
    click.argument("target", metavar="PATH.py:NAME"),
    click.option("-b", "--batch", type=int, default=1, show_default=True,
                 help="Per-rank micro-batch; B in --input specs."),
    click.option("--dtype", "dtype", default=None,
                 help="Cast parameters, buffers and floating inputs: fp32, bf16, fp16, fp8 or a torch name."),
    click.option("--kwargs", "kwargs_json", default=None, help="Constructor arguments as a JSON object."),
    click.option("-k", "--kwarg", "kwarg_items", multiple=True, metavar="NAME=VALUE",
                 help="One constructor argument (a Python literal, else a string); repeatable."),
    click.option("--input", "input_specs", multiple=True, metavar="SPEC",
                 help="Input spec such as 'long[B,1024]<50257' or 'x=float32[B,3]'; repeatable, in order."),
    click.option("--input-requires-grad", is_flag=True, help="Inputs need gradients (adds dInput to backward)."),
    click.option("--loss-output", type=int, default=None,
                 help="Index of the floating-point output that is the loss (default: sum of all)."),
    click.option("--causal-attention", type=click.Choice(CAUSAL_CONVENTIONS), default="full", show_default=True,
                 help="Count causal attention kernels in full or halved."),
    click.option("--count-recompute", is_flag=True,
                 help="Count the ops activation checkpointing re-runs in the backward (hardware FLOPs)."),
    click.option("--tokens-per-example", type=int, default=None,
                 help="Tokens per example for per-token figures and 6·N·D (default: the first integer input's length)."),
    click.option("--optimizer", default="adamw", show_default=True,
                 help="torch.optim name (sgd, adam, adamw, adagrad, rmsprop, ...), none, or PATH.py:Name."),
    click.option("--optim-arg", "optim_items", multiple=True, metavar="NAME=VALUE",
                 help="Optimizer option such as momentum=0.9 or betas=(0.9,0.95); repeatable."),
    click.option("--amp", default=None, help="Autocast dtype (bf16 or fp16): fp32 parameters, low-precision activations."),
    click.option("--master-weights", is_flag=True,
                 help="With --dtype bf16/fp16: the optimizer steps fp32 master copies."),
    click.option("--gpu", default=None, help="Target GPU (h100, h100-pcie, h200, a100, a100-40gb): CUDA kernel rules, fit."),
    click.option("--world-size", type=int, default=1, show_default=True, help="Data-parallel ranks."),
    click.option("--shard", default="none", show_default=True,
                 help="Partitioning across ranks: none, zero1, zero2, zero3, fsdp."),
    click.option("--no-max-batch", "no_max_batch", is_flag=True,
                 help="With --gpu: skip the search for the largest batch that fits (it costs a few traces)."),
    click.option("--no-dedup", "no_dedup", is_flag=True,
                 help="Trace every repeated block instead of replaying proven-identical ones."),
    click.option("--debug", is_flag=True, help="Show tracebacks."),
)


def model_options(fn):
    for option in reversed(MODEL_OPTIONS):
        fn = option(fn)
    return fn


def to_config(target, batch, dtype, kwargs_json, kwarg_items, input_specs, input_requires_grad, loss_output,
              causal_attention, tokens_per_example, optimizer, optim_items, amp, master_weights, gpu,
              world_size, shard, no_dedup=False, no_max_batch=False, count_recompute=False, **_) -> Config:
    kwargs = {}
    if kwargs_json is not None:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--kwargs is not valid JSON ({e.msg}); write e.g. --kwargs '{{\"d\": 512}}'") from None
        if not isinstance(kwargs, dict):
            raise UsageError("--kwargs must be a JSON object such as '{\"d\": 512}'")
    kwargs.update(parse_kwarg(item) for item in kwarg_items)
    return Config(
        target=target, batch=batch, kwargs=kwargs,
        inputs=tuple(parse_input_spec(s) for s in input_specs),
        dtype=parse_dtype(dtype) if dtype is not None else None, input_requires_grad=input_requires_grad,
        loss_output=loss_output, causal_attention=causal_attention, tokens_per_example=tokens_per_example,
        optimizer=optimizer, optim_args=dict(parse_optim_arg(i) for i in optim_items),
        amp=parse_dtype(amp) if amp is not None else None, master_weights=master_weights, gpu=gpu,
        world_size=world_size, shard=shard, dedup=not no_dedup, find_max_batch=not no_max_batch,
        count_recompute=count_recompute,
    )


__all__ = ["model_options", "to_config"]
