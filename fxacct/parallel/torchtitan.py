"""One rank of a torchtitan job (``torchtitan:MODULE:CONFIG``), accounted as fxacct accounts any rank
under ``--mesh``: torchtitan builds the model on meta and parallelizes it with the model spec's own
``parallelize_fn`` (FSDP2, tensor/sequence, context and expert parallelism, activation checkpointing,
float8) on its own ParallelDims meshes under the fake process group; the step traced is the model's
forward, torchtitan's own loss, the backward and the optimizer's step, below DTensor, on rank 0.

torchtitan's train_step around it (trainer.py::train_step) also clips the gradients' norm and sums the
token count over the batch mesh; those are not in the traced step (docs/torchtitan.md).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fxacct.errors import UsageError, classify
from fxacct.load.torchtitan import adapted, check_moe_layers, job_config, routing_of
from fxacct.parallel.accounts import ParallelAccount
from fxacct.parallel.collectives import register_cp_ops, rows
from fxacct.parallel.engine import fake_group
from fxacct.parallel.pipeline_split import meta_like
from fxacct.parallel.rank_capture import RankCapturer, materialize
from fxacct.parallel.timing import predict_time, throughput
from fxacct.step import Profile, account_step
from fxacct.trace.targets import cuda_sdpa

OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd"}  # torchtitan's optimizer_name -> fxacct's


class TitanStep(torch.nn.Module):
    """The traced module: torchtitan's model, then torchtitan's loss (a sum over the local tokens
    divided by the global count, trainer.py::_forward_backward_body), returned as the loss.
    ``extra``: the model's keyword inputs built from the data beforehand (positions, flex
    attention's block masks: trainer.py::post_dataloading_process).

    A pipeline stage (``pipelined``) before the last (``loss_fn`` None) returns what it sends on, kept
    on meta in ``sent``; the last stage calls the loss as the schedule does
    (pipeline_parallel.py::_scalar_loss_fn: no positions)."""

    def __init__(self, model: torch.nn.Module, loss_fn, extra: dict, valid_tokens: int, pipelined: bool = False):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.extra = extra
        self.valid_tokens = valid_tokens
        self.pipelined = pipelined
        self.sent: torch.Tensor | None = None

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        pred = self.model(inputs, **self.extra)
        if self.loss_fn is None:
            self.sent = meta_like(pred)
            return pred
        loss_kwargs = {"positions": self.extra["positions"]} if "positions" in self.extra and not self.pipelined else {}
        loss, _ = self.loss_fn(pred, labels, torch.tensor(self.valid_tokens), **loss_kwargs)
        return loss


def world_size(job) -> int:
    """torchtitan's world: ep is carved out of the fsdp x cp x tp ranks (parallel_dims.py::build_mesh)."""
    p = job.parallelism
    return (p.pipeline_parallel_degree * p.data_parallel_replicate_degree * p.data_parallel_shard_degree
            * p.context_parallel_degree * p.tensor_parallel_degree)


def process_groups(pdims) -> dict:
    """process-group name -> (torchtitan's mesh dimensions that run on it, its size). One process group
    may serve several dimensions (fsdp=4,ep=4: fsdp, ep and the world are the same four ranks): the
    label names each, "fsdp/ep"; the flattened batch and loss meshes only where nothing else runs."""
    import torch.distributed as dist

    names: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    meshes = [(label, m) for label, m in pdims._single_axis_meshes.items() if label not in ("batch", "loss")]
    meshes += [(label, pdims._single_axis_meshes[label]) for label in ("batch", "loss")
               if label in pdims._single_axis_meshes]
    for label, mesh in meshes:
        group = mesh.get_group()
        if group.size() == 1:
            continue
        dim = "fsdp" if label == "dp_shard" else label
        found = names.setdefault(group.group_name, [])
        if dim not in found and (not found or dim not in ("batch", "loss")):
            found.append(dim)
        sizes[group.group_name] = group.size()
    order = ("pp", "dp_replicate", "fsdp", "efsdp", "cp", "tp", "ep", "batch", "loss")
    groups = {g: ("/".join(sorted(n, key=order.index)), sizes[g]) for g, n in names.items()}
    groups.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
    return groups


def build_model(job, pdims, modules: list[str] | None = None):
    """torchtitan's model on meta, parallelized by its model spec's parallelize_fn (trainer.py::__init__);
    with ``modules``, only the pipeline stage that keeps them, cut as pipeline_llm cuts it
    (pipeline_parallel.py::_split_module) before it is parallelized."""
    from torchtitan.distributed.pipeline_parallel import _split_module
    from torchtitan.tools import utils as titan_utils
    from torchtitan.trainer import TORCH_DTYPE_MAP

    spec = job.model_spec
    spec.model.update_from_config(config=job)
    with torch.device("meta"), titan_utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
        model = spec.model.build()
    if modules is not None:
        model = _split_module(model, modules)
    return spec.parallelize_fn(model, parallel_dims=pdims, training=job.training, parallelism=job.parallelism,
                               compile_config=job.compile, ac_config=job.activation_checkpoint,
                               dump_folder=job.dump_folder)


def whole_model(config) -> torch.nn.Module:
    """torchtitan's model of ``config.target`` on meta, as its config builds it, unparallelized
    (what fxacct plan reads its blocks and parameter bytes from)."""
    job = job_config(replace(config, mesh=None))  # every degree 1; first: a usage error without torchtitan
    from torchtitan.tools import utils as titan_utils
    from torchtitan.trainer import TORCH_DTYPE_MAP

    with adapted():
        spec = job.model_spec
        spec.model.update_from_config(config=job)
        with torch.device("meta"), titan_utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
            return spec.model.build()


def compute_dtype(config) -> torch.dtype:
    """The dtype torchtitan's matmuls run in: FSDP2's mixed-precision parameters, which
    apply_fsdp_to_decoder installs at every degree (training.mixed_precision_param)."""
    job = job_config(replace(config, mesh=None))  # first: a usage error where torchtitan is missing
    from torchtitan.trainer import TORCH_DTYPE_MAP

    return TORCH_DTYPE_MAP[job.training.mixed_precision_param]


def loss_of(job, model):
    """torchtitan's loss; a chunked one computes the output projection itself (trainer.py: set_lm_head).

    The account is of a steady-state step, and torchtitan's first step changes what the later ones
    do: ChunkedLossWrapper turns resharding off on ``lm_head``'s FSDP2 unit for its chunks and, after
    them, sets it to True (loss.py: ``lm_head.set_reshard_after_forward(True)``, ``..._backward(True)``),
    where apply_fsdp_to_decoder had left the last unit (the final norm with ``lm_head``) without
    resharding after forward. From the second step on that unit is freed after the norm and gathered
    again by the loss (a real gloo run: one more all-gather per step than the first step's), so the
    unit starts the traced step as the first one leaves it."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper

    loss_fn = job.loss.build(compile_config=job.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        if isinstance(model.lm_head, FSDPModule):
            model.lm_head.set_reshard_after_forward(True)
            model.lm_head.set_reshard_after_backward(True)
    return loss_fn


def model_inputs(model, batch: int, seq: int) -> dict:
    """The keyword inputs the data loader's positions give (trainer.py::post_dataloading_process):
    one document per sequence, so the positions are 0..seq-1; flex attention's block masks are
    built from them, on real tensors (only their metadata reaches the traced step)."""
    from torchtitan.models.common.attention import FlexAttention

    first = getattr(getattr(model, "config", None), "first_attention", None)
    if not isinstance(getattr(first, "inner_attention", None), FlexAttention.Config):
        return {}
    positions = torch.arange(seq).repeat(batch, 1)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}


def step_inputs(job, pdims, model, batch: int, seq: int, data: tuple | None = None):
    """(tokens, labels, keyword inputs) of rank 0: under cp, its shard of the sequence, as torchtitan's
    prepare_context_parallel_input cuts it (with its load balancer) from the whole batch. ``data``:
    real (tokens, labels) of the whole sequence (a real run's, fxacct.runtime.titan_run); default
    meta tensors (zeros under cp, whose sharding reads the positions)."""
    extra = model_inputs(model, batch, seq)
    if not pdims.cp_enabled:
        if data is not None:
            return *data, extra
        tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
        return tokens, tokens.clone(), extra
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    register_cp_ops()
    if not extra:
        raise UsageError(f"--mesh cp={pdims.cp}: torchtitan's context parallelism needs positions (flex attention); "
                         f"{job.model_spec.name}'s attention takes none")
    par = job.parallelism
    tokens, labels = data if data is not None else (torch.zeros(batch, seq, dtype=torch.long),) * 2
    return prepare_context_parallel_input(tokens, labels.clone(), extra, pdims.get_mesh("cp"), torch.device("cpu"),
                                          par.context_parallel_load_balancer, par.context_parallel_ptrr_mask_key)


def optimizer_config(job, config):
    """fxacct's optimizer for torchtitan's one catch-all param group (components/optimizer/optimizer.py)."""
    groups = job.optimizer.param_groups
    name = OPTIMIZERS.get(groups[0].optimizer_name) if len(groups) == 1 else None
    if name is None:
        raise UsageError(f"{config.target}: its optimizer ({', '.join(g.optimizer_name for g in groups)} over "
                         f"{len(groups)} parameter groups) is not one fxacct steps; override it with "
                         "-- --optimizer... or profile without it")
    args = {k: v for k, v in groups[0].optimizer_kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
    return replace(config, optimizer=name, optim_args=args, loss="model")


def profile_torchtitan(config, with_inference: bool = False) -> Profile:
    """Rank 0's account of the torchtitan job ``config.target`` (a Config whose mesh holds the degrees)."""
    job = job_config(config)  # first: a usage error where torchtitan is missing
    from torchtitan.distributed.parallel_dims import ParallelDims

    world = world_size(job)
    step_config = optimizer_config(job, config)
    routing = routing_of(job, config)
    # a CUDA target's attention kernel (fxacct.trace.targets), chosen in the forward and its recompute alike
    with adapted(sdpa=cuda_sdpa if config.gpu is not None else None, routing=routing), fake_group(world):
        try:
            pdims = ParallelDims.from_config(job.parallelism, world)
            pdims.world_mesh  # noqa: B018 (builds torchtitan's meshes: parallel_dims.py::build_mesh)
            model = build_model(job, pdims)
            check_moe_layers(routing, model)
            loss_fn = loss_of(job, model)
            seq, batch = job.training.seq_len, job.training.local_batch_size
            tokens, labels, extra = step_inputs(job, pdims, model, batch, seq)
            step = TitanStep(model, loss_fn, extra, batch * seq)
        except UsageError:
            raise
        except Exception as e:
            raise classify(e, f"building {config.target} with torchtitan") from e
        prof = account_rank(step_config, step, (tokens, labels), pdims, with_inference)
    ep = job.parallelism.expert_parallel_degree
    notes = (routing.note(ep),) if ep > 1 else ()
    return replace(prof, model_class=type(model).__name__, warnings=prof.warnings + notes)


def account_rank(step_config, step: TitanStep, inputs: tuple, pdims, with_inference: bool = False) -> Profile:
    """The Profile of one rank's ``step`` (a TitanStep, parallelized on ``pdims``' meshes, under the
    fake process group), with its collectives in a ParallelAccount."""
    prepared = materialize(step)
    rank = RankCapturer(step, inputs, {}, prepared, process_groups(pdims))
    prof = account_step(step_config, rank, with_inference)
    found, cap, spec = rank.collectives, prof.capture, step_config.mesh
    peak = prof.memory.rank_peak.bytes if prof.memory.rank_peak else None
    time, seconds = predict_time((cap, peak), spec, step_config, found)  # with --gpu: the mesh's step time
    params = list(step.model.parameters())
    parallel = ParallelAccount(spec, 0, found, rows(found, seconds if time else None), time,
                               throughput(time, prof.accounting.totals, spec, step_config, cap.graph),
                               node_seconds=seconds if time else None,
                               model_params=sum(t.numel() for t in params),  # a DTensor's: global
                               model_frozen_params=sum(t.numel() for t in params if not t.requires_grad),
                               resizes=rank.training_resizes(cap))
    return replace(prof, config=step_config, parallel=parallel)
