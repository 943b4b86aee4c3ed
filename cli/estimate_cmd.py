"""`fxacct estimate`: the back-of-envelope calculators (train-time, max-params, flops) as short
tables or JSON. Flags → one fxacct.tools.estimate call → report."""

from __future__ import annotations

import json
import re

import click

from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.load.profile_file import read_profile
from fxacct.load.quantities import parse_count
from fxacct.report import estimate_text
from fxacct.tools import estimate
from fxacct_cli.main import cli, examples, write_output
from fxacct_cli.options import (
    AMP,
    DEBUG,
    GPU_HELP,
    MASTER_WEIGHTS,
    MFU,
    OPTIM_ARG,
    OPTIMIZER,
    OUTPUT,
    OUTPUT_GROUP,
    SHARD,
    count_or_none,
    dtype_or_none,
    format_option,
    group,
    max_memory_option,
    world_size_option,
)

FORMAT = format_option("table", "json")
WORLD_SIZE = world_size_option("--gpus")  # --gpus: the same flag, as the calculators speak of GPUs
PARAMS = click.option("--params", default=None, metavar="N", help="Parameters N of 6·N·D, e.g. 70e9 (default: none).")


def tokens_option(required: bool):
    return click.option("--tokens", required=required, default=None, metavar="D",
                        help="Training tokens D of 6·N·D, e.g. 15e12" + ("." if required else " (default: none)."))


def _emit(result, fmt, output, render, to_doc) -> None:
    text = json.dumps(to_doc(result), indent=2) + "\n" if fmt == "json" else render(result)
    write_output(text, output)


@cli.group("estimate", epilog=examples(
    "fxacct estimate train-time --params 70e9 --tokens 15e12 --world-size 1024 --gpu h100 --mfu 0.3",
    "fxacct estimate max-params --world-size 8 --shard zero3 --gpu h100",
    "fxacct estimate flops --mm 256x512x256"))
def estimate_group():
    """Back-of-envelope calculators: train-time, max-params, flops (every constant sourced)."""


@estimate_group.command("train-time", epilog=examples(
    "fxacct estimate train-time --params 70e9 --tokens 15e12 --world-size 1024 --gpu h100 --mfu 0.3",
    "fxacct estimate train-time --from profile.json --tokens 1e12 --world-size 64 --gpu h100 --mfu 0.4"))
@group("Model", PARAMS, click.option(
    "--from", "from_file", default=None, metavar="PROFILE.json",
    help="Use this profile's own FLOPs per token (forward + backward, matmul + attention) instead of 6·N (default: none)."),
    tokens_option(required=True))
@group("Hardware and parallelism", click.option("--gpu", required=True, help=f"{GPU_HELP} whose peak FLOP/s is used."),
       MFU, click.option("--dtype", default=None,
                         help="Matmul precision whose peak is used (default bf16, as the seeds; with --from, the "
                              "profile's --amp, else its --dtype, else fp32, as `fxacct check` does)."),
       WORLD_SIZE)
@group(OUTPUT_GROUP, FORMAT, OUTPUT, DEBUG)
def train_time_command(params, from_file, tokens, gpu, mfu, dtype, world_size, fmt, output, debug):
    """Days (and 30-day months) to train on D tokens."""
    if params is not None and from_file is not None:
        raise UsageError("give --params N or --from PROFILE.json, not both")
    result = estimate.train_time(
        tokens=parse_count(tokens, "--tokens"), gpu=gpu, mfu=mfu, world_size=world_size,
        params=count_or_none(params, "--params"), profile_doc=read_profile(from_file) if from_file else None,
        peak_dtype=dtype_or_none(dtype))
    _emit(result, fmt, output, estimate_text.render_train_time, estimate_text.train_time_document)


@estimate_group.command("max-params", epilog=examples(
    "fxacct estimate max-params --world-size 8 --shard zero3 --gpu h100 --optimizer adamw --dtype fp32",
    "fxacct estimate max-params --gpu h100 --dtype bf16 --master-weights"))
@group("Precision and optimizer", OPTIMIZER, OPTIM_ARG,
       click.option("--dtype", default=None, help="Parameter (and gradient) dtype: fp32 (default), bf16, fp16, fp8."),
       AMP, MASTER_WEIGHTS)
@group("Hardware and parallelism", click.option(
    "--gpu", default=None, help=f"{GPU_HELP} whose nominal memory (marketed GB × 1e9: 80e9 for an H100) is the budget "
         "(default: none, then --max-memory)."),
    max_memory_option("Per-GPU memory instead of --gpu's, e.g. 80GB or 79.6GiB (GB = 1e9 B, GiB = 2^30 B; "
                      "default: none, then --gpu)."),
    SHARD, WORLD_SIZE)
@group(OUTPUT_GROUP, FORMAT, OUTPUT, DEBUG)
def max_params_command(gpu, max_memory, optimizer, optim_items, dtype, amp, master_weights, shard, world_size,
                       fmt, output, debug):
    """The largest model whose parameters, gradients, master weights and optimizer state fit each
    GPU (activations not included)."""
    config = Config(optimizer=optimizer, optim_args=tuple(optim_items), dtype=dtype,
                    amp=amp, master_weights=master_weights, world_size=world_size, shard=shard)
    result = estimate.max_params(config, gpu=gpu, capacity_bytes=max_memory)
    _emit(result, fmt, output, estimate_text.render_max_params, estimate_text.max_params_document)


def _mm(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if m is None:
        raise UsageError(f"malformed --mm {text!r}: expected MxNxP such as 256x512x256 for (M×N)@(N×P)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@estimate_group.command("flops", epilog=examples("fxacct estimate flops --mm 256x512x256",
                                                 "fxacct estimate flops --params 70e9 --tokens 15e12"))
@group("Inputs", click.option("--mm", default=None, metavar="MxNxP",
                              help="(M×N)@(N×P) matmul: 2·M·N·P FLOPs (default: none)."),
       PARAMS, tokens_option(required=False))
@group(OUTPUT_GROUP, FORMAT, OUTPUT, DEBUG)
def flops_command(mm, params, tokens, fmt, output, debug):
    """FLOPs of a matmul (--mm) or of training (--params --tokens: 6·N·D)."""
    if (mm is not None) == (params is not None or tokens is not None):
        raise UsageError("give either --mm MxNxP or --params N --tokens D")
    if mm is not None:
        result = estimate.matmul_flops(*_mm(mm))
    else:
        if params is None or tokens is None:
            raise UsageError("6·N·D needs both --params N and --tokens D")
        result = estimate.training_flops(parse_count(params, "--params"), parse_count(tokens, "--tokens"))
    _emit(result, fmt, output, estimate_text.render_flops, estimate_text.flops_document)
