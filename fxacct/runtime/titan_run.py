"""One rank of a torchtitan job run for real, for ``--mesh ... --runtime --device cpu``
(fxacct.runtime.gloo_run starts the ranks and measures the step): torchtitan's model built on meta
and parallelized as the account builds it (fxacct.parallel.torchtitan), materialized on the CPU
and initialized by torchtitan's own ``init_weights``; real tokens (one seed: every rank the same
batch); the step the account traces (TitanStep: forward, torchtitan's loss, backward) and the
optimizer as the account steps it (torch's, with torchtitan's hyper-parameters).

Only the router is not the account's: its decisions are real, where the account assumes balanced
routing or ``--expert-load``'s histogram. Each rank records the tokens its router sent to each
expert in every MoE layer (``expert_load``: the lists, in layer order, that ``--expert-load``
takes as ``{"layers": ...}``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from fxacct.load.torchtitan import adapted, job_config, patched
from fxacct.parallel.torchtitan import TitanStep, build_model, loss_of, optimizer_config, step_inputs, world_size
from fxacct.runtime.build import SEED


@dataclass
class TitanRun:
    """What gloo_run measures: the model and optimizer to track, the inputs, one step, and the
    router's counts per MoE layer (token dispatcher -> tokens per expert, the step's first call)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    inputs: tuple
    step: TitanStep
    routed: dict = field(default_factory=dict)

    def __call__(self) -> torch.Tensor:
        loss = self.step(*self.inputs)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    def expert_load(self) -> list[list[int]] | None:
        return [counts for counts in self.routed.values()] or None


def _recording(dispatch, routed: dict):
    """AllToAllTokenDispatcher.dispatch, keeping each layer's first counts of the step."""
    def wrapped(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        routed.setdefault(id(self), [int(c) for c in num_local_tokens_per_expert_E.tolist()])
        return dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)

    return wrapped


@contextlib.contextmanager
def prepared(config):
    """This process's rank of ``config``'s torchtitan job, ready to step (inside torchtitan's
    adapter, which the step needs: its device type and attention stand-in)."""
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    from torchtitan.distributed.parallel_dims import ParallelDims

    job = job_config(config)
    step_config = optimizer_config(job, config)
    world = world_size(job)
    routed: dict = {}
    dispatcher = token_dispatcher.AllToAllTokenDispatcher
    with adapted(real=True), patched(dispatcher, "dispatch", _recording(dispatcher.dispatch, routed)):
        pdims = ParallelDims.from_config(job.parallelism, world)
        pdims.world_mesh  # noqa: B018 (builds torchtitan's meshes)
        model = build_model(job, pdims)
        _sum_reductions(model)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))  # trainer.py::__init__
        loss_fn = loss_of(job, model)
        batch, seq = job.training.local_batch_size, job.training.seq_len
        torch.manual_seed(SEED)
        vocab = job.model_spec.model.vocab_size
        data = (torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq)))
        tokens, labels, extra = step_inputs(job, pdims, model, batch, seq, data)
        opt = step_config.optimizer_spec().build([p for p in model.parameters() if p.requires_grad])
        yield TitanRun(model, opt, (tokens, labels), TitanStep(model, loss_fn, extra, batch * seq), routed)


def _sum_reductions(model: torch.nn.Module) -> None:
    """torchtitan turns FSDP2's gradient division off (fsdp.py::disable_fsdp_gradient_division:
    factor 1.0), which FSDP2 then reduces with ReduceOp.PREMUL_SUM(1.0)
    (_fsdp_collectives.py::_get_gradient_divide_factors), an op gloo does not have ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"): a plain SUM and a division by 1.0, the same buffers and result."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


__all__ = ["TitanRun", "prepared"]
