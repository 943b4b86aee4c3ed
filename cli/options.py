"""Every option more than one command takes, defined once (help, type, default), and the
conversion of the model options to a Config. Defaults come from the library (fxacct.load.flags,
which Config takes its own from, RuntimeOptions, DEFAULT_MFU), so each is stated in one place.

Nothing here imports torch: a usage error (a malformed -k, a missing file, an unwritable -o, a bad
--mesh, --dtype or --gpu) answers before torch, transformers or networkx load (tests/test_startup.py)."""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import click
import cloup

from fxacct.devices import SDPA_BACKENDS
from fxacct.dtypes import parse_dtype
from fxacct.errors import UsageError
from fxacct.load.flags import CAUSAL_CONVENTIONS, COMPILE_MODES, DEFAULTS, LOSSES, check_request, parse_kwarg
from fxacct.load.mesh import parse_mesh
from fxacct.load.output_path import check_writable
from fxacct.load.quantities import DEFAULT_MFU, parse_count
from fxacct.units import parse_bytes
from fxacct_cli.main import report_stream

if TYPE_CHECKING:
    from fxacct.load.config import Config
FORMATS = ("table", "json", "csv", "markdown", "html")


def format_option(*choices: str):
    return click.option("--format", "fmt", type=click.Choice(choices or FORMATS), default="table",
                        show_default=True, help="Output format.")


def _writable(ctx, param, value):
    if value is not None and value != "-":
        check_writable(value)  # fail before the work, not after it
    return value


def file_option(*decls: str, metavar: str = "FILE", help: str):
    """An output file checked for writability when the flags are read ('-' is stdout)."""
    return click.option(*decls, default=None, metavar=metavar, callback=_writable, help=help)


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError as e:
        raise UsageError(f"--max-memory: {e}") from None
    if size <= 0:
        raise UsageError(f"--max-memory must be positive, got {value}")
    return size


def max_memory_option(help: str):
    """--max-memory SIZE, parsed to bytes (GB = 1e9 B, GiB = 2^30 B)."""
    return click.option("--max-memory", default=None, metavar="SIZE", callback=_size, help=help)


def world_size_option(*aliases: str):
    """--world-size (and its aliases: estimate's --gpus). Click keeps the last of a repeated
    option; two different values (``--world-size 8 --gpus 16``) are refused instead."""
    def one(ctx, param, values):
        if len(set(values)) > 1:
            raise click.BadParameter(f"given as {' and '.join(map(str, values))}; give one value", ctx=ctx,
                                     param=param)
        return values[-1] if values else DEFAULTS.world_size

    return click.option("--world-size", *aliases, "world_size", type=int, multiple=True, callback=one,
                        help=f"Data-parallel ranks (GPUs).  [default: {DEFAULTS.world_size}]")


OUTPUT = file_option("-o", "--output", help="Write to FILE (atomically) instead of stdout (default: stdout; '-' is stdout).")
DEBUG = click.option("--debug", is_flag=True, help="Show tracebacks.")
MFU = click.option("--mfu", type=float, default=DEFAULT_MFU, show_default=True,
                   help="Model FLOPs utilization: achieved / peak FLOP/s, in (0, 1].")
GPU_HELP = "Target GPU (h100, h100-96gb, h100-pcie, h200, a100, a100-40gb, b200, l40s)"
GPU = click.option("--gpu", default=None,
                   help=f"{GPU_HELP}: CUDA kernel rules, capacity, peak FLOP/s (default: this machine's CPU).")
DTYPE = click.option("--dtype", "dtype", default=None,
                     help="Cast parameters, buffers and floating inputs: fp32, bf16, fp16, fp8 or a torch name "
                          "(default: the model's own dtypes).")
AMP = click.option("--amp", default=None,
                   help="Autocast dtype (bf16 or fp16): fp32 parameters, low-precision activations (default: off).")
MASTER_WEIGHTS = click.option("--master-weights", is_flag=True,
                              help="With --dtype bf16/fp16: the optimizer steps fp32 master copies.")
FP8 = click.option("--fp8", default=None, metavar="RECIPE",
                   help="Float8 training: linear layers converted with torchao's Float8Linear, recipe tensorwise or "
                        "rowwise (casts, scales and _scaled_mm traced as they run; needs pip install 'fxacct[fp8]'; "
                        "default: off).")
OPTIMIZER = click.option("--optimizer", default=DEFAULTS.optimizer, show_default=True,
                         help="torch.optim name (sgd, adam, adamw, adagrad, rmsprop, ...), none, or PATH.py:Name.")
OPTIM_ARG = click.option("--optim-arg", "optim_items", multiple=True, metavar="NAME=VALUE",
                         help="Optimizer option such as momentum=0.9 or betas=(0.9,0.95); repeatable.")
SHARD = click.option("--shard", default=DEFAULTS.shard, show_default=True,
                     help="Partitioning across ranks: none, zero1, zero2, zero3, fsdp.")

LOSS = click.option("--loss", type=click.Choice(LOSSES), default=DEFAULTS.loss, show_default=True,
                    help="The loss: sum of the outputs (any model; the model's FLOPs are the same under "
                         "every loss), cross-entropy or mse against random targets (cross-entropy: classes in "
                         "the last dim up to [B,T,V], else dim 1 as in [B,C,H,W]), or model (the loss the "
                         "model returns, e.g. with labels). Give cross-entropy for a language model: its "
                         "log-softmax over the vocabulary is often the peak, which sum leaves out.")
HF_CLASS = click.option("--hf-class", default=None, metavar="CLASS",
                        help="hf:PATH: the transformers class (default: the config's architectures, "
                             "else AutoModelForCausalLM).")
SEQ_LEN = click.option("--seq-len", type=int, default=None,
                       help="Sequence length of the default Hugging Face inputs (default: the config's "
                            "maximum positions, at most 2048); of a torchtitan job (default: its config's).")

CHECKPOINT = click.option("--checkpoint", "checkpoint", multiple=True, metavar="PATTERN",
                          help="What-if: wrap the modules whose name matches PATTERN (a glob such as 'h.*' or "
                               "'layers.*') in non-reentrant activation checkpointing; repeatable.")
CHECKPOINT_POLICY = click.option("--checkpoint-policy", default=None, metavar="save-matmuls|PATH.py:fn",
                                 help="Selective checkpointing with --checkpoint: save the matmul outputs, or "
                                      "a policy function for create_selective_checkpoint_contexts (default: plain checkpointing).")
COMPILE = click.option("--compile", "compile_model", is_flag=True,
                       help="Account the step as torch.compile(model) runs it: the saved tensors and recompute "
                            "of inductor's partitioner; side by side with eager (one device: use --compile-blocks under --mesh).")
COMPILE_BLOCKS = click.option("--compile-blocks", "compile_blocks", multiple=True, metavar="PATTERN",
                              help="Compile each module whose name matches PATTERN (a glob such as 'layers.*'), "
                                   "as torchtitan compiles each block (also under --mesh); repeatable.")
COMPILE_MODE = click.option("--compile-mode", type=click.Choice(COMPILE_MODES), default="default", show_default=True,
                            help="torch.compile's mode, with --compile or --compile-blocks (it does not change the "
                                 "partition; docs/limits.md).")
COSTS = click.option("--costs", "costs", multiple=True, metavar="PATH.py",
                     help="Load cost formulas for custom ops (fxacct.costs.register); repeatable.")

TARGET = click.argument("target", metavar="PATH.py:NAME|MODULE:NAME|hf:PATH|torchtitan:MODULE:CONFIG")
# after the target and --: torchtitan's own overrides of a torchtitan:MODULE:CONFIG job (--training.steps 3)
TORCHTITAN_ARGS = click.argument("torchtitan_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TORCHTITAN_ARGS...]")

# The option groups of --help (cloup). Add an option to a group with one line in its list; a
# command shows the groups it is decorated with (model_options: the first three).
def _batch(**extra):
    return click.option("-b", "--batch", type=int, default=DEFAULTS.batch, show_default=True,
                        help="Per-rank micro-batch; B in --input specs; a torchtitan job's local batch.", **extra)


BATCH = _batch()
MODEL_AND_INPUTS = [
    BATCH,
    click.option("--kwargs", "kwargs_json", default=None,
                 help="Constructor arguments as a JSON object (default: none)."),
    click.option("-k", "--kwarg", "kwarg_items", multiple=True, metavar="NAME=VALUE",
                 help="One constructor argument (a Python literal, else a string); repeatable."),
    click.option("--input", "input_specs", multiple=True, metavar="SPEC",
                 help="Input spec such as 'long[B,1024]<50257' or 'x=float32[B,3]'; repeatable, in order "
                      "(default: the model's example_inputs(batch))."),
    click.option("--input-requires-grad", is_flag=True, help="Inputs need gradients (adds dInput to backward)."),
    click.option("--loss-output", type=int, default=None,
                 help="Index of the floating-point output the loss takes (default: all for sum, the first otherwise)."),
    LOSS, HF_CLASS, SEQ_LEN,
    CHECKPOINT,
    CHECKPOINT_POLICY,
    COMPILE, COMPILE_BLOCKS, COMPILE_MODE,
    COSTS,
    click.option("--tokens-per-example", type=int, default=None,
                 help="Tokens per example for per-token figures and 6·N·D (default: the first integer input's length)."),
    click.option("--causal-attention", type=click.Choice(CAUSAL_CONVENTIONS), default=DEFAULTS.causal_attention,
                 show_default=True, help="Count causal attention kernels in full or halved."),
    click.option("--count-recompute", is_flag=True,
                 help="Count the ops activation checkpointing re-runs in the backward (hardware FLOPs)."),
    click.option("--no-dedup", "no_dedup", is_flag=True,
                 help="Trace every repeated block instead of replaying proven-identical ones."),
]
PRECISION_AND_OPTIMIZER = [DTYPE, AMP, MASTER_WEIGHTS, FP8, OPTIMIZER, OPTIM_ARG]
HARDWARE_AND_PARALLELISM = [
    GPU, world_size_option(), SHARD,
    click.option("--no-max-batch", "no_max_batch", is_flag=True,
                 help="With --gpu: skip the search for the largest batch that fits (it costs a few traces)."),
    click.option("--alloc-conf", "alloc_conf", default=None, metavar="STRING",
                 help="With --gpu: PYTORCH_CUDA_ALLOC_CONF for the caching-allocator replay, e.g. "
                      "expandable_segments:True (default: the environment's PYTORCH_CUDA_ALLOC_CONF or "
                      "PYTORCH_ALLOC_CONF, else torch's defaults)."),
    click.option("--sdpa-backend", "sdpa_backend", type=click.Choice(SDPA_BACKENDS), default="auto", show_default=True,
                 help="With --gpu: the attention kernel scaled_dot_product_attention runs, timed at its published "
                      "rates; auto is torch 2.13's choice (cuDNN on H100/B200, else flash; flash first under "
                      "TORCH_CUDNN_SDPA_DEPRIORITIZED=1). Name the backend a run forces or an older torch picked "
                      "(before 2.9: flash on H100)."),
]
OUTPUT_GROUP = "Output"
RUNTIME_GROUP = "Runtime (a real run)"
GROUPS = (("Model and inputs", MODEL_AND_INPUTS), ("Precision and optimizer", PRECISION_AND_OPTIMIZER),
          ("Hardware and parallelism", HARDWARE_AND_PARALLELISM))


def group(title: str, *options):
    """One titled section of --help (cloup.option_group)."""
    return cloup.option_group(title, *options)


def _mesh(ctx, param, value):
    return parse_mesh(value) if value is not None else None  # a malformed mesh fails when the flags are read


def _mesh_option(**extra):
    from fxacct.load.mesh import DIMS

    # the dimensions from fxacct.load.mesh.DIMS, so the help lists every one the parser takes
    return click.option("--mesh", default=None, callback=_mesh, metavar="DIM=N,...",
                        help=f"Device mesh, outer to inner ({', '.join(DIMS)}): trace one rank of the model "
                             "parallelized by PyTorch's own engine, e.g. fsdp=8,tp=8 or pp=2,fsdp=4 (default: one device). "
                             "cp and ep: torchtitan targets only; ep is carved out of the fsdp x cp x tp ranks, as "
                             "torchtitan does, so it does not multiply the world size.",
                        **extra)


def _microbatches(**extra):
    return click.option("--microbatches", type=int, default=None,
                        help="With --mesh pp=P: micro-batches per step (default P).", **extra)


MESH = _mesh_option()
MICROBATCHES = _microbatches()
# options a command takes only to refuse them with a reason (fxacct plan chooses these per layout):
# hidden from its --help, still parsed so the refusal can say why
HIDDEN = {BATCH: _batch(hidden=True), MESH: _mesh_option(hidden=True), MICROBATCHES: _microbatches(hidden=True)}
MESH_OPTIONS = (
    MESH,
    click.option("--parallelize", default=None, metavar="PATH.py:fn",
                 help="With --mesh: your function fn(model, mesh) that parallelizes the model "
                      "(default: the model's tensor-parallel plan and FSDP2 per repeated block)."),
    click.option("--reshard-after-forward/--no-reshard-after-forward", default=DEFAULTS.reshard_after_forward,
                 show_default=True, help="With --mesh fsdp=N: FSDP2 frees gathered blocks after their forward."),
    click.option("--zero1", is_flag=True, default=False,
                 help="With --mesh dp=N (DDP): ZeRO-1, each rank keeps and steps the optimizer state of its share "
                      "of the parameters and broadcasts them after the step (torch's ZeroRedundancyOptimizer)."),
    click.option("--gpus-per-node", type=click.IntRange(min=1), default=DEFAULTS.gpus_per_node, show_default=True,
                 help="With --mesh and --gpu: GPUs per node; inner mesh dims run over NVLink, outer ones over InfiniBand."),
    click.option("--interconnect", default=None, metavar="NAME",
                 help="With --mesh and --gpu: the network between nodes (ib-ndr, ib-hdr, roce, roce-200); default: "
                      "the GPU's reference node's (DGX H100: ib-ndr, DGX A100: ib-hdr). No effect on one device."),
    click.option("--pp-split", default=None, metavar="PATH.py:fn|FQN,...",
                 help="With --mesh pp=P: fn(model, stage, stages) returning the stage's module, or the module "
                      "FQNs where stages 1.. begin (layers.2); default: blocks balanced by traced FLOPs."),
    MICROBATCHES,
    click.option("--pp-schedule", type=click.Choice(("gpipe", "1f1b", "interleaved-1f1b")), default=DEFAULTS.pp_schedule,
                 show_default=True, help="With --mesh pp=P: the pipeline schedule (torch.distributed.pipelining's)."),
    click.option("--pp-stages-per-rank", type=int, default=None, metavar="V",
                 help="With --pp-schedule interleaved-1f1b: pipeline stages per rank (default 2)."),
    click.option("--expert-load", "expert_load", default=None, metavar="FILE",
                 help="With a torchtitan MoE target and --mesh ...,ep=E: a measured routing histogram, JSON "
                      "{\"experts\": [tokens per expert, ...]} or {\"layers\": [[...], ...]}; the busiest "
                      "expert-parallel rank is accounted (default: balanced routing)."),
)


CONFIRM = click.option("--confirm", type=click.IntRange(min=0), default=1, show_default=True, metavar="N",
                       help="Trace the N best layouts in full (the others are screened from short traces).")


def _shown(options, hide) -> list:
    return [HIDDEN[o] if o in hide else o for o in options]


def mesh_options(fn=None, *, hide=()):
    """The --mesh flags, their own section of --help; ``hide``: options (MESH, MICROBATCHES) parsed
    but left out of --help (``@mesh_options(hide=(MESH,))``)."""
    def apply(fn):
        return group("Device mesh (many GPUs)", *_shown(MESH_OPTIONS, hide))(fn)

    return apply if fn is None else apply(fn)


def with_mesh(config: Config, mesh=None, parallelize=None, reshard_after_forward=True,
              gpus_per_node=DEFAULTS.gpus_per_node, pp_split=None, microbatches=None,
              pp_schedule=DEFAULTS.pp_schedule, pp_stages_per_rank=None, zero1=False, interconnect=None,
              expert_load=None, **_) -> Config:
    """The --mesh flags added to a Config (validated by Config)."""
    from dataclasses import replace

    return replace(config, mesh=mesh, parallelize=parallelize, reshard_after_forward=reshard_after_forward,
                   gpus_per_node=gpus_per_node, interconnect=interconnect, pp_split=pp_split, microbatches=microbatches,
                   pp_schedule=pp_schedule, pp_stages_per_rank=pp_stages_per_rank, zero1=zero1,
                   expert_load=expert_load)


def model_options(fn=None, *, hide=()):
    """The model, precision and hardware flags in their sections of --help; ``hide`` as mesh_options'
    (BATCH)."""
    def apply(fn):
        for title, options in reversed(GROUPS):
            fn = group(title, *_shown(options, hide))(fn)
        return TARGET(fn)

    return apply if fn is None else apply(fn)


def terminal_width() -> int | None:
    """The width the text report fits: COLUMNS when set, else the terminal's; None (no limit)
    when stdout is not a terminal (a file or a pipe keeps every character)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if report_stream().isatty():
        return shutil.get_terminal_size().columns
    return None


def count_or_none(text: str | None, flag: str) -> int | None:
    """'7e9', '7B' -> 7000000000 (fxacct.load.quantities), None when the flag was not given."""
    return parse_count(text, flag) if text is not None else None


def dtype_or_none(text: str | None):
    return parse_dtype(text) if text is not None else None


def _kwargs(kwargs_json: str | None, kwarg_items) -> dict:
    kwargs = {}
    if kwargs_json is not None:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--kwargs is not valid JSON ({e.msg}); write e.g. --kwargs '{{\"d\": 512}}'") from None
        if not isinstance(kwargs, dict):
            raise UsageError("--kwargs must be a JSON object such as '{\"d\": 512}'")
    kwargs.update(parse_kwarg(item) for item in kwarg_items)
    return kwargs


def to_config(target, batch, dtype, kwargs_json, kwarg_items, input_specs, input_requires_grad, loss_output,
              causal_attention, tokens_per_example, optimizer, optim_items, amp, master_weights, gpu,
              world_size, shard, no_dedup=False, no_max_batch=False, count_recompute=False,
              loss=DEFAULTS.loss, hf_class=None, seq_len=None, checkpoint=(), checkpoint_policy=None,
              costs=(), mesh=None, alloc_conf=None, fp8=None, torchtitan_args=(), compile_model=False,
              compile_blocks=(), compile_mode="default", sdpa_backend="auto", parallelize=None, **_) -> Config:
    # the flags' strings go to Config as they are: it parses dtypes, input specs and optimizer
    # options (one parser each, the library's). With --mesh (with_mesh adds its other flags): a clash
    # with --shard is named as that, not as --shard's own want of a --world-size. First the checks
    # that need no torch (Config imports it), so those usage errors answer at once
    kwargs = _kwargs(kwargs_json, kwarg_items)
    check_request(target, dtype, amp, gpu)
    from fxacct.load.config import Config

    return Config(
        target=target, batch=batch, kwargs=kwargs,
        inputs=tuple(input_specs), dtype=dtype, input_requires_grad=input_requires_grad,
        loss_output=loss_output, causal_attention=causal_attention, tokens_per_example=tokens_per_example,
        optimizer=optimizer, optim_args=tuple(optim_items), amp=amp,
        master_weights=master_weights, gpu=gpu, world_size=world_size, shard=shard, dedup=not no_dedup,
        find_max_batch=not no_max_batch, count_recompute=count_recompute,
        loss=loss, hf_class=hf_class, seq_len=seq_len,
        checkpoint=tuple(checkpoint), checkpoint_policy=checkpoint_policy, costs=tuple(costs), mesh=mesh,
        parallelize=parallelize if mesh is not None else None,  # plan takes one for the meshes it makes
        alloc_conf=alloc_conf, fp8=fp8,
        torchtitan_args=tuple(torchtitan_args),
        compile=compile_model, compile_blocks=tuple(compile_blocks), compile_mode=compile_mode,
        sdpa_backend=sdpa_backend,
    )


__all__ = ["TORCHTITAN_ARGS", "FORMATS", "format_option", "file_option", "max_memory_option", "world_size_option", "OUTPUT",
           "DEBUG", "MFU", "GPU", "GPU_HELP", "BATCH", "MESH", "MICROBATCHES", "DTYPE", "AMP", "MASTER_WEIGHTS", "FP8", "OPTIMIZER", "OPTIM_ARG",
           "SHARD", "LOSS", "HF_CLASS", "SEQ_LEN", "CHECKPOINT", "CHECKPOINT_POLICY", "COMPILE", "COMPILE_BLOCKS", "COMPILE_MODE", "COSTS", "CONFIRM", "model_options", "mesh_options", "with_mesh", "group", "terminal_width", "OUTPUT_GROUP", "RUNTIME_GROUP",
           "MODEL_AND_INPUTS", "PRECISION_AND_OPTIMIZER", "HARDWARE_AND_PARALLELISM", "to_config", "count_or_none", "dtype_or_none"]
