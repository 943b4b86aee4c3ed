"""The account of one rank under ``--mesh``: the engine parallelizes, rank 0 is traced, the
collectives are marked, and the single-device stages (annotate, account, memory) run unchanged."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fxacct.parallel.collectives import CollectiveNode, CollectiveRow, alias_waits, mark, mesh_groups, rows
from fxacct.parallel.engine import device_mesh, fake_group
from fxacct.parallel.fsdp_storage import unsave_resized, with_resizes
from fxacct.parallel.mesh import MeshSpec, parse_mesh
from fxacct.parallel.rank_capture import prepare, rank_capture
from fxacct.parallel.timing import ParallelTime, Throughput, predict_time, throughput


@dataclass(frozen=True)
class ParallelAccount:
    mesh: MeshSpec
    rank: int  # the representative rank traced
    collectives: tuple[CollectiveNode, ...]  # every collective node, in issue order
    rows: tuple[CollectiveRow, ...]  # summed by op, mesh dim, phase and module
    time: ParallelTime | None = None  # with --gpu: the critical path over compute and communication
    throughput: Throughput | None = None
    pipeline: object = None  # fxacct.parallel.pipeline.PipelineAccount under --mesh pp=P
    node_seconds: dict | None = None  # collective node -> predicted seconds (with --gpu), else None
    model_params: int | None = None  # the whole model's parameters (global shapes), not this rank's shards
    model_frozen_params: int = 0  # of them, those that do not require grad
    resizes: tuple = ()  # FSDP2's storage resizes in the training trace (fxacct.parallel.fsdp_storage)

    @property
    def comm_wire_bytes(self) -> int:
        """What this rank sends in a step: its collectives' wire bytes, and under pp its stage's
        sends (activations forward, input gradients back; a send's wire bytes are its bytes)."""
        sends = self.pipeline.stages[self.rank].send_bytes if self.pipeline is not None else 0
        return sum(r.wire_bytes for r in self.rows) + sends


def profile_parallel(config, loader=None, with_inference: bool = True):
    """``loader(config) -> (model on meta, args, kwargs, _)``, default fxacct.profile.load_model
    (fxacct.parallel.pipeline passes one stage's). ``with_inference=False`` skips the inference
    forward (its peak is then None): the planner's screen reads only the training step."""
    from fxacct.account.accounting import account
    from fxacct.account.annotate import annotate
    from fxacct.memory import account as memory_account
    from fxacct.memory.peak import lifetimes, walk
    from fxacct.profile import Profile, load_model, precision_warnings, tokens_per_example

    spec = parse_mesh(config.mesh)
    load_model = loader or load_model
    with fake_group(spec.world_size):
        mesh = device_mesh(spec)
        model, args, kwargs, _ = load_model(config)
        built = type(model).__name__  # FSDP2 renames the class of what it wraps (FSDPLlama)
        hf_model = type(model).__module__.startswith("transformers.")
        prepared = prepare(model, spec, mesh, config)  # parallelized and materialized once
        cap, resizes = rank_capture(model, args, kwargs, prepared, config)
        alias_waits(cap)
        cap = unsave_resized(cap, resizes)
        annotate(cap.graph, config.causal_attention)
        found = mark(cap.graph, mesh_groups(mesh, spec))
        inference = None
        if with_inference:
            inference, resizes_i = rank_capture(model, args, kwargs, prepared, config, inference=True)
            alias_waits(inference)
    tokens = config.tokens_per_example or tokens_per_example(args, kwargs, config.batch)
    acct = account(cap, config.batch, tokens, config.count_recompute)
    memory = memory_account.assemble(
        cap, acct, model, config.dtype,
        walk(with_resizes(lifetimes(cap), resizes)) if cap.has_backward else None,
        walk(with_resizes(lifetimes(inference), resizes_i)) if inference is not None else None)
    time, seconds = predict_time((cap, memory.rank_peak.bytes if memory.rank_peak else None), spec, config, found)
    parallel = ParallelAccount(spec, 0, found, rows(found, seconds if time else None), time,
                               throughput(time, acct.totals, spec, config), node_seconds=seconds if time else None,
                               model_params=sum(t.numel() for t in model.parameters()),  # a DTensor's: global
                               model_frozen_params=sum(t.numel() for t in model.parameters() if not t.requires_grad),
                               resizes=tuple(resizes))
    notes = precision_warnings(cap) + whatif_warnings(config) + skipped_gather_warnings(parallel.rows, config)
    notes += general_attention_warnings(hf_model, spec, kwargs)
    if config.gpu is not None and memory.rank_peak is not None:
        memory = replace(memory, fit=rank_fit(config.gpu, memory.rank_peak.bytes))
    return Profile(config, acct, memory, cap, notes, parallel=parallel, model_class=built)


def rank_fit(gpu: str, peak: int):
    """A rank's peak against the GPU's capacity. No largest batch: under a mesh the batch is each
    rank's share of a global one, which ``fxacct plan`` searches."""
    from fxacct.memory.account import Fit
    from fxacct.predict.devices import get_device

    return Fit.on(get_device(gpu), peak)


def skipped_gather_warnings(rows, config) -> tuple[str, ...]:
    """fxacct's own FSDP2 wrapping reshards every block after its forward, so the backward gathers
    each block again. Fewer backward gathers than forward ones mean FSDP2's pre-backward hook did
    not run for some block: an in-place op on a block's output view (``ReLU(inplace=True)`` after
    it) drops it, and eager PyTorch then fails the step on the freed parameters."""
    if config.parallelize is not None or not config.reshard_after_forward:
        return ()

    def gathers(phase, root: bool):
        return sum(r.count for r in rows if r.op == "all_gather" and "fsdp" in r.mesh_dim and r.phase == phase
                   and (root or r.module))

    # the root ("") keeps its parameters gathered after forward, so the forward's blocks are the
    # gathers of modules other than the root; in backward a block's gather prefetched while the
    # root's own ops run (a final logit softcap, a bias on the logits) is the root's: all count
    forward, backward = gathers("forward", root=False), gathers("backward", root=True)
    if backward >= forward:
        return ()
    return (f"FSDP2 gathered {forward} blocks in forward but only {backward} again in backward: where a block's "
            "output is a view changed in place (e.g. ReLU(inplace=True) after the block), FSDP2 skips its "
            "pre-backward hook and eager PyTorch fails the step on its freed parameters; make that op out of place",)


def general_attention_warnings(hf_model: bool, spec: MeshSpec, kwargs: dict) -> tuple[str, ...]:
    """Under tp a Hugging Face model's activations are DTensors, whose local ops carry no known
    values, so transformers takes its general attention path (an explicit mask, k/v repeated for
    grouped-query attention), which eager takes only with a padded batch or a given
    attention_mask (docs/limits.md)."""
    if not hf_model or spec.size("tp") == 1 or "attention_mask" in kwargs:
        return ()
    return (f"--mesh {spec}: under tensor parallelism transformers' attention takes its general path (an explicit "
            "mask, k/v repeated for grouped-query attention), which eager takes only for a padded batch or a given "
            "attention_mask: for an unpadded batch the peak is an upper bound (a Qwen3 at tp=2: 1.3-3% over a real "
            "run; docs/limits.md)",)


def whatif_warnings(config) -> tuple[str, ...]:
    """The checkpointing what-if (memory saved against FLOPs recomputed, module by module) is
    traced on one device: under --mesh it is not, and the report says so rather than drop it."""
    if not config.checkpoint:
        return ()
    return ("--checkpoint with --mesh: the rank's step is traced checkpointed; the what-if table (the same step "
            "without checkpointing, module by module) is computed on one device only: run without --mesh to see it",)


def profile_mesh(config):
    """--mesh: one rank's account; with pp=P, stage 0's, carrying every stage's (PipelineAccount)."""
    spec = parse_mesh(config.mesh)
    if spec.size("pp") == 1:
        return profile_parallel(config)
    from fxacct.parallel.pipeline import profile_pipeline

    pipe = profile_pipeline(config)
    first = pipe.stages[0].profile
    par = first.parallel  # the collectives of rank 0's step: its stage's, as the schedule drives FSDP2
    par = ParallelAccount(spec, 0, (), (), pipeline=pipe) if par is None else replace(
        par, mesh=spec, pipeline=pipe, rows=pipe.stages[0].collectives)
    memory = first.memory if config.gpu is None else replace(first.memory, fit=rank_fit(config.gpu, pipe.peak_bytes))
    return replace(first, config=config, parallel=par, warnings=first.warnings, memory=memory,
                   model_class=pipe.model_class)  # stage 0's module may be a cut of it (InterpreterModule)
