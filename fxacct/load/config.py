"""The frozen configuration one account is computed for (the CLI's flags, gathered once).
Validation happens here, before any tracing, so a bad value fails fast with a usage error."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

from fxacct.errors import UsageError
from fxacct.load.mesh import MeshSpec, check_config, parse_mesh
from fxacct.devices import get_device
from fxacct.load.specs import OPTIMIZERS, LossSpec, OptimizerSpec, check

CAUSAL_CONVENTIONS = ("full", "halved")
AMP_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Config:
    target: str | None = None  # "PATH.py:Name", for reports
    batch: int = 1
    kwargs: dict = field(default_factory=dict)  # constructor arguments
    inputs: tuple = ()  # InputSpec; empty: the model's example_inputs(batch)
    dtype: torch.dtype | None = None  # cast parameters, buffers and floating inputs
    input_requires_grad: bool = False
    loss_output: int | None = None
    causal_attention: str = "full"
    count_recompute: bool = False  # activation checkpointing's re-run ops in the backward FLOPs
    tokens_per_example: int | None = None
    optimizer: str = "adamw"  # a torch.optim name, "none", or PATH.py:Name
    optim_args: dict = field(default_factory=dict)
    amp: torch.dtype | None = None  # autocast dtype
    master_weights: bool = False
    gpu: str | None = None  # a key of fxacct.devices.DEVICES
    world_size: int = 1
    shard: str = "none"
    find_max_batch: bool = True  # with a gpu: search the largest batch that fits
    dedup: bool = True  # trace repeated blocks once where proven identical (fxacct.trace.replay)
    loss: str = "sum"  # fxacct.trace.loss.LOSSES: sum, cross-entropy, mse, model
    hf_class: str | None = None  # hf:PATH: the transformers class (default from the config)
    seq_len: int | None = None  # the default inputs' sequence length (Hugging Face models)
    mesh: str | None = None  # "fsdp=8,tp=8" (fxacct.load.mesh): trace one rank of the parallelized model
    parallelize: str | None = None  # "PATH.py:fn", called as fn(model, mesh)
    reshard_after_forward: bool = True  # FSDP2's flag for the blocks fxacct shards itself
    gpus_per_node: int = 8  # --mesh with --gpu: inner mesh dims within a node (NVLink), outer ones across
    pp_split: str | None = None  # "PATH.py:fn", fn(model, stage, stages) -> the stage's module
    microbatches: int | None = None  # per step, with --mesh pp=P (default P)
    pp_schedule: str = "1f1b"  # gpipe, 1f1b or interleaved-1f1b (torch.distributed.pipelining's schedules)
    checkpoint: tuple[str, ...] = ()  # globs over module FQNs wrapped in activation checkpointing
    checkpoint_policy: str | None = None  # selective checkpointing: "save-matmuls" or PATH.py:fn
    costs: tuple[str, ...] = ()  # PATH.py files of user cost formulas (fxacct.costs.register)
    pp_stages_per_rank: int | None = None  # interleaved-1f1b: pipeline stages per rank (default 2)

    def __post_init__(self):
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
        self._check_loading()
        if isinstance(self.mesh, str):
            object.__setattr__(self, "mesh", parse_mesh(self.mesh))
        if self.mesh is not None:  # first: --mesh with --shard names the clash, not a --world-size to add
            check_config(self)
        check(self.shard, self.world_size)
        if self.mesh is None and self.parallelize is not None:
            raise UsageError("--parallelize needs --mesh (e.g. --mesh fsdp=2,tp=2): it is called as fn(model, mesh)")
        self.optimizer_spec().resolve()

    def _check_loading(self):
        LossSpec(self.loss, self.loss_output)
        if self.seq_len is not None and self.seq_len <= 0:
            raise UsageError(f"--seq-len must be a positive integer, got {self.seq_len}")
        if self.checkpoint_policy is not None and not self.checkpoint:
            raise UsageError("--checkpoint-policy needs --checkpoint PATTERN (the modules it applies to)")

    def stage(self, mesh: MeshSpec | None) -> Config:
        """The Config one pipeline stage is traced under: the rest of the mesh (None: one device),
        without the flags that say how the pipeline runs (the stage is one micro-batch's step)."""
        return replace(self, mesh=mesh, parallelize=self.parallelize if mesh is not None else None,
                       pp_split=None, microbatches=None, pp_stages_per_rank=None)

    def optimizer_spec(self):
        args = dict(self.optim_args)
        if self.gpu is not None and self.optimizer.lower() in _FOREACH and "foreach" not in args:
            args["foreach"] = True  # fxacct.trace.targets rule 4: CUDA tensors default to foreach
        return OptimizerSpec(self.optimizer, args)


def _foreach_optimizers():

    return {k for k, cls in OPTIMIZERS.items() if "foreach" in inspect.signature(cls.__init__).parameters}


_FOREACH = _foreach_optimizers()
