"""The frozen configuration one account is computed for (the CLI's flags, gathered once).
Validation happens here, before any tracing, so a bad value fails fast with a usage error."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field, fields, replace

import torch

from fxacct.devices import SDPA_BACKENDS, get_device
from fxacct.dtypes import dtype_name, parse_dtype
from fxacct.errors import UsageError
from fxacct.interconnects import network
from fxacct.load import fp8
from fxacct.load.alloc_conf import AllocConf, from_environment
from fxacct.load.flags import CAUSAL_CONVENTIONS, COMPILE_MODES, DEFAULTS
from fxacct.load.inputs import InputSpec, parse_input_spec
from fxacct.load.mesh import MeshSpec, check_config, parse_mesh
from fxacct.load.specs import OPTIMIZERS, LossSpec, OptimizerSpec, check, parse_optim_arg
from fxacct.load.torchtitan import is_torchtitan

AMP_DTYPES = (torch.bfloat16, torch.float16)


# what a string field takes, where a wrong kind of value is told to give one
_STRING_HINTS = {"target": " such as 'examples/gpt2.py:GPT' or 'hf:DIR'", "mesh": " such as 'fsdp=8,tp=8'",
                 "optimizer": " such as 'adamw', 'sgd', 'none' or 'PATH.py:Name'", "gpu": " such as 'h100'"}


@dataclass(frozen=True)
class Config:
    """One account's request. Fields take what the CLI's flags take, as strings too:
    ``Config(dtype="bf16", amp="fp16", inputs=["long[B,128]<50257"], checkpoint="h.*",
    optim_args=["momentum=0.9"])`` is the same request as ``--dtype bf16 --input 'long[B,128]<50257'
    ...``; a value of the wrong kind is a one-line UsageError naming the field."""

    target: str | None = None  # "PATH.py:Name", for reports
    batch: int = DEFAULTS.batch
    kwargs: dict = field(default_factory=dict)  # constructor arguments
    inputs: tuple = ()  # InputSpec; empty: the model's example_inputs(batch)
    dtype: torch.dtype | None = None  # cast parameters, buffers and floating inputs
    input_requires_grad: bool = False
    loss_output: int | None = None
    causal_attention: str = DEFAULTS.causal_attention
    count_recompute: bool = False  # activation checkpointing's re-run ops in the backward FLOPs
    tokens_per_example: int | None = None
    optimizer: str = DEFAULTS.optimizer  # a torch.optim name, "none", or PATH.py:Name
    optim_args: dict = field(default_factory=dict)
    amp: torch.dtype | None = None  # autocast dtype
    master_weights: bool = False
    gpu: str | None = None  # a key of fxacct.devices.DEVICES
    world_size: int = DEFAULTS.world_size
    shard: str = DEFAULTS.shard
    find_max_batch: bool = True  # with a gpu: search the largest batch that fits
    dedup: bool = True  # trace repeated blocks once where proven identical (fxacct.trace.replay)
    loss: str = DEFAULTS.loss  # fxacct.trace.loss.LOSSES: sum, cross-entropy, mse, model
    hf_class: str | None = None  # hf:PATH: the transformers class (default from the config)
    seq_len: int | None = None  # the default inputs' sequence length (Hugging Face models)
    mesh: str | None = None  # "fsdp=8,tp=8" (fxacct.load.mesh): trace one rank of the parallelized model
    parallelize: str | None = None  # "PATH.py:fn", called as fn(model, mesh)
    reshard_after_forward: bool = DEFAULTS.reshard_after_forward  # FSDP2's flag for the blocks fxacct shards itself
    gpus_per_node: int = DEFAULTS.gpus_per_node  # --mesh with --gpu: inner mesh dims within a node (NVLink), outer ones across
    interconnect: str | None = None  # the network between nodes (fxacct.interconnects); None: the GPU's node's
    pp_split: str | None = None  # "PATH.py:fn", fn(model, stage, stages) -> the stage's module
    microbatches: int | None = None  # per step, with --mesh pp=P (default P)
    pp_schedule: str = DEFAULTS.pp_schedule  # gpipe, 1f1b or interleaved-1f1b (torch.distributed.pipelining's schedules)
    checkpoint: tuple[str, ...] = ()  # globs over module FQNs wrapped in activation checkpointing
    checkpoint_policy: str | None = None  # selective checkpointing: "save-matmuls" or PATH.py:fn
    costs: tuple[str, ...] = ()  # PATH.py files of user cost formulas (fxacct.costs.register)
    pp_stages_per_rank: int | None = None  # interleaved-1f1b: pipeline stages per rank (default 2)
    # PYTORCH_CUDA_ALLOC_CONF for the caching-allocator replay (fxacct.load.alloc_conf); None: the
    # environment's PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, else torch's defaults
    alloc_conf: str | None = None
    zero1: bool = False  # ZeRO-1 over --mesh dp=N: the optimizer state sharded (ZeroRedundancyOptimizer)
    expert_load: str | None = None  # a measured routing histogram for ep (fxacct.load.expert_load)
    fp8: str | None = None  # "tensorwise" or "rowwise": linear layers as torchao's Float8Linear (fxacct.load.fp8)
    torchtitan_args: tuple[str, ...] = ()  # torchtitan:MODULE:CONFIG: torchtitan's own overrides (after --)
    compile: bool = False  # account the step as torch.compile(model) runs it (fxacct.trace.compiled)
    compile_blocks: tuple[str, ...] = ()  # globs: compile each matching module instead (regional)
    compile_mode: str = "default"  # torch.compile's mode (COMPILE_MODES)
    sdpa_backend: str = "auto"  # the attention kernel a --gpu prediction times (fxacct.devices.SDPA_BACKENDS)

    @property
    def compiled(self) -> bool:
        """Whether the step is accounted compiled (--compile or --compile-blocks)."""
        return self.compile or bool(self.compile_blocks)

    def __post_init__(self):
        self._normalize()
        if self.batch <= 0:
            raise UsageError(f"--batch must be a positive integer, got {self.batch}")
        if self.causal_attention not in CAUSAL_CONVENTIONS:
            raise UsageError(f"--causal-attention must be one of {', '.join(CAUSAL_CONVENTIONS)}")
        if self.tokens_per_example is not None and self.tokens_per_example <= 0:
            raise UsageError(f"--tokens-per-example must be positive, got {self.tokens_per_example}")
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise UsageError(f"--dtype {str(self.dtype).removeprefix('torch.')} is not a floating-point dtype: "
                             "parameters are cast to it; use fp32, bf16, fp16 or fp8")
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise UsageError(f"--amp {str(self.amp).removeprefix('torch.')} is not an autocast dtype: use bf16 or fp16")
        if self.amp is not None and self.dtype is not None and self.dtype != torch.float32:
            raise UsageError("--amp keeps fp32 parameters and casts inside autocast; drop --dtype "
                             "(or use --dtype bf16 --master-weights for pure low-precision training)")
        if self.master_weights and (self.dtype is None or self.dtype == torch.float32):
            raise UsageError("--master-weights keeps fp32 copies of low-precision parameters: "
                             "use it with --dtype bf16 or --dtype fp16")
        if self.gpu is not None:
            get_device(self.gpu)
        if self.alloc_conf is not None and not isinstance(self.alloc_conf, str):
            raise UsageError(f"Config(alloc_conf={self.alloc_conf!r}): give a string such as 'expandable_segments:True'")
        if self.alloc_conf is not None or self.gpu is not None:
            self.allocator_conf()  # a bad --alloc-conf (or, for a GPU, environment value) fails here, before any trace
        if self.alloc_conf is not None and self.gpu is None:
            raise UsageError("--alloc-conf sets PYTORCH_CUDA_ALLOC_CONF for the caching-allocator replay, which runs "
                             "on a CUDA target only: add --gpu NAME (e.g. --gpu h100) or drop --alloc-conf")
        if self.interconnect is not None:
            network(self.interconnect)
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise UsageError(f"unknown --sdpa-backend {self.sdpa_backend!r}: use one of {', '.join(SDPA_BACKENDS)}")
        self._check_loading()
        if isinstance(self.mesh, str):
            object.__setattr__(self, "mesh", parse_mesh(self.mesh))
        if self.mesh is not None:  # first: --mesh with --shard names the clash, not a --world-size to add
            check_config(self)
        check(self.shard, self.world_size)
        if self.mesh is None and self.parallelize is not None:
            raise UsageError("--parallelize needs --mesh (e.g. --mesh fsdp=2,tp=2): it is called as fn(model, mesh)")
        self._check_zero1()
        fp8.check(self.fp8)
        if self.fp8 is not None and self.dtype is not None and self.dtype.itemsize == 1:
            raise UsageError(f"--fp8 {self.fp8} keeps the linear layers' weights in high precision and casts them to "
                             f"float8 for each matmul, so --dtype {dtype_name(self.dtype)} leaves it nothing to cast "
                             "from: give --dtype bf16 (or fp32), or drop --fp8")
        self.optimizer_spec().resolve()
        self._check_expert_load()
        if self.torchtitan_args and not is_torchtitan(self.target):
            raise UsageError(f"arguments after the model ({' '.join(self.torchtitan_args)}) are torchtitan's "
                             "overrides, for torchtitan:MODULE:CONFIG targets only; drop them")

    def _check_expert_load(self):
        """--expert-load routes a torchtitan MoE job's tokens among expert-parallel ranks: it needs one."""
        if self.expert_load is None:
            return
        if not is_torchtitan(self.target):
            raise UsageError("--expert-load routes tokens among expert-parallel ranks, which fxacct builds for "
                             "torchtitan:MODULE:CONFIG MoE targets only; drop it")
        if self.mesh is None or self.mesh.size("ep") == 1:
            raise UsageError("--expert-load says how tokens are routed among expert-parallel ranks, but --mesh has no "
                             "ep dimension: add one (e.g. --mesh fsdp=4,ep=4) or drop --expert-load")

    def _check_zero1(self):
        """--zero1, and DDP (dp without fsdp) where it is built in: alone or with tp refused later."""
        m = self.mesh
        if m is not None and m.size("pp") > 1 and m.size("dp") > 1 and m.size("fsdp") == 1 \
                and not is_torchtitan(self.target):  # torchtitan's parallelize_fn builds its own
            raise UsageError(f"--mesh {m}: DDP (dp without fsdp) inside pipeline stages is not built in; use "
                             f"--mesh pp={m.size('pp')},dp={m.size('dp')},fsdp=S (HSDP in each stage) or your own --parallelize")
        if not self.zero1:
            return
        names = () if self.mesh is None else self.mesh.names
        if "fsdp" in names:
            raise UsageError(f"--zero1 with --mesh {self.mesh}: FSDP2 already shards the optimizer state with the "
                             "parameters; drop --zero1 (ZeRO-1 goes with plain data parallelism, --mesh dp=N)")
        if "dp" not in names:
            raise UsageError("--zero1 shards the optimizer state over data-parallel ranks: add --mesh dp=N "
                             "(or use --world-size N --shard zero1 for the arithmetic estimate)")
        if len(names) > 1:
            raise UsageError(f"--zero1 with --mesh {self.mesh}: ZeRO-1 goes with plain data parallelism only; "
                             f"use --mesh dp={self.mesh.size('dp')}")
        if self.optimizer.lower() == "none":
            raise UsageError("--zero1 shards the optimizer state, and --optimizer none has none: drop one of them")

    def _normalize(self):
        """The CLI's strings parsed as the CLI parses them (one parser each), so the library takes
        what the flags take; anything else of the wrong kind is a UsageError, not an AttributeError later."""
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("dtype", "amp"):
            value = getattr(self, name)
            if isinstance(value, str):
                put(name, parse_dtype(value))
            elif value is not None and not isinstance(value, torch.dtype):
                raise UsageError(f"Config({name}={value!r}): give a dtype name such as 'bf16', 'fp16', "
                                 "'float32' or a torch.dtype")
        for name in ("batch", "world_size", "gpus_per_node", "tokens_per_example", "loss_output", "seq_len",
                     "microbatches", "pp_stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UsageError(f"Config({name}={value!r}): give an integer")
        specs = (self.inputs,) if isinstance(self.inputs, (str, InputSpec)) else self.inputs
        if not isinstance(specs, (tuple, list)):
            raise UsageError(f"Config(inputs={self.inputs!r}): give input specs such as ['long[B,1024]<50257']")
        put("inputs", tuple(parse_input_spec(s) if isinstance(s, str) else s for s in specs))
        if not all(isinstance(s, InputSpec) for s in self.inputs):
            raise UsageError(f"Config(inputs={self.inputs!r}): give input specs such as ['long[B,1024]<50257']")
        self._check_kinds()
        for name in ("checkpoint", "costs", "torchtitan_args", "compile_blocks"):
            value = getattr(self, name)
            items = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else (None,)
            if not all(isinstance(v, str) for v in items):
                raise UsageError(f"Config({name}={value!r}): give a string or a list of strings")
            put(name, items)
        if not isinstance(self.kwargs, dict):
            raise UsageError(f"Config(kwargs={self.kwargs!r}): give the constructor arguments as a dict")
        args = self.optim_args
        if isinstance(args, str):
            args = (args,)
        if not isinstance(args, dict):
            if not all(isinstance(a, str) for a in args):
                raise UsageError(f"Config(optim_args={self.optim_args!r}): give a dict or NAME=VALUE strings")
            put("optim_args", dict(parse_optim_arg(a) for a in args))

    def _check_kinds(self):
        """A switch is True or False (a string such as 'no' would read as on); a name, spec or pattern
        is a string (a path-like target its path; a mesh its parsed MeshSpec too)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise UsageError(f"Config({f.name}={value!r}): give True or False")
            if f.type not in ("str", "str | None") or isinstance(value, str) or (value is None and f.type != "str"):
                continue
            if f.name == "target" and isinstance(value, os.PathLike):
                object.__setattr__(self, "target", os.fspath(value))
            elif not (f.name == "mesh" and isinstance(value, MeshSpec)):
                raise UsageError(f"Config({f.name}={value!r}): give a string{_STRING_HINTS.get(f.name, '')}")
        if self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")

    def _check_loading(self):
        LossSpec(self.loss, self.loss_output)
        if self.seq_len is not None and self.seq_len <= 0:
            raise UsageError(f"--seq-len must be a positive integer, got {self.seq_len}")
        if self.compile_mode not in COMPILE_MODES:
            raise UsageError(f"--compile-mode {self.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
        if self.compile_mode != "default" and not self.compiled:
            raise UsageError("--compile-mode needs --compile or --compile-blocks PATTERN")
        if self.compile and self.compile_blocks:
            raise UsageError("--compile compiles the whole model and --compile-blocks each matching module: give one")
        if self.compile and self.mesh is not None:
            raise UsageError("--compile under --mesh would trace FSDP2's and DTensor's hooks into one graph: compile "
                             "each block with --compile-blocks PATTERN instead, as torchtitan does")
        if self.checkpoint_policy is not None and not self.checkpoint:
            raise UsageError("--checkpoint-policy needs --checkpoint PATTERN (the modules it applies to)")

    def stage(self, mesh: MeshSpec | None) -> Config:
        """The Config one pipeline stage is traced under: the rest of the mesh (None: one device),
        without the flags that say how the pipeline runs (the stage is one micro-batch's step)."""
        return replace(self, mesh=mesh, parallelize=self.parallelize if mesh is not None else None,
                       pp_split=None, microbatches=None, pp_stages_per_rank=None)

    def allocator_conf(self) -> AllocConf:
        """The caching allocator's settings: --alloc-conf, else the environment, else torch's defaults."""
        return from_environment(self.alloc_conf)

    def optimizer_spec(self):
        args = dict(self.optim_args)
        if self.gpu is not None and self.optimizer.lower() in _FOREACH and "foreach" not in args:
            args["foreach"] = True  # fxacct.trace.targets rule 4: CUDA tensors default to foreach
        return OptimizerSpec(self.optimizer, args, zero1=self.zero1)


def _foreach_optimizers():

    return {k for k, cls in OPTIMIZERS.items() if "foreach" in inspect.signature(cls.__init__).parameters}


_FOREACH = _foreach_optimizers()
