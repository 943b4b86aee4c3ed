"""The account of one rank under ``--mesh``: the engine parallelizes, rank 0 is traced, the
collectives are marked, and the single-device stages (annotate, account, memory) run unchanged."""

from __future__ import annotations

from dataclasses import replace

from fxacct.load.mesh import MeshSpec
from fxacct.load.source import load_model
from fxacct.parallel.accounts import ParallelAccount
from fxacct.parallel.collectives import mesh_groups, rows
from fxacct.parallel.engine import device_mesh, fake_group
from fxacct.parallel.rank_capture import RankCapturer, prepare
from fxacct.parallel.timing import predict_time, throughput
from fxacct.step import Profile, account_step


def profile_parallel(config, loader=None, with_inference: bool = True) -> Profile:
    """``loader(config) -> (model on meta, args, kwargs, _)``, default fxacct.load.source.load_model
    (fxacct.parallel.pipeline passes one stage's). ``with_inference=False`` skips the inference
    forward (its peak is then None): the planner's screen reads only the training step."""
    spec = config.mesh
    with fake_group(spec.world_size):
        mesh = device_mesh(spec)
        model, args, kwargs, _ = (loader or load_model)(config)
        built = type(model).__name__  # FSDP2 renames the class of what it wraps (FSDPLlama)
        hf_model = type(model).__module__.startswith("transformers.")
        prepared = prepare(model, spec, mesh, config, (args, kwargs))  # parallelized and materialized once
        rank = RankCapturer(model, args, kwargs, prepared, mesh_groups(mesh, spec))
        prof = account_step(config, rank, with_inference)
    cap, memory, found = prof.capture, prof.memory, rank.collectives
    time, seconds = predict_time((cap, memory.rank_peak.bytes if memory.rank_peak else None), spec, config, found)
    parallel = ParallelAccount(spec, 0, found, rows(found, seconds if time else None), time,
                               throughput(time, prof.accounting.totals, spec, config, cap.graph),
                               node_seconds=seconds if time else None,
                               model_params=sum(t.numel() for t in model.parameters()),  # a DTensor's: global
                               model_frozen_params=sum(t.numel() for t in model.parameters() if not t.requires_grad),
                               resizes=rank.training_resizes(cap))
    notes = whatif_warnings(config) + skipped_gather_warnings(parallel.rows, config)
    notes += general_attention_warnings(hf_model, spec, kwargs)
    return replace(prof, warnings=prof.warnings + notes, parallel=parallel, model_class=built)


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
    """The checkpointing and torch.compile what-ifs (the same step without checkpointing, or eager,
    module by module) are traced on one device: under --mesh they are not (the JSON's ``checkpoint``
    and ``compile`` are null), and the report says so rather than drop them."""
    notes = ()
    if config.checkpoint:
        notes += ("--checkpoint with --mesh: the rank's step is traced checkpointed; the what-if table (the same "
                  "step without checkpointing, module by module) is computed on one device only: run without --mesh "
                  "to see it",)
    if config.compiled:
        notes += (f"{'--compile' if config.compile else '--compile-blocks'} with --mesh: the rank's step is traced "
                  "compiled; the what-if table (the same step eager, module by module) is computed on one device "
                  "only: run without --mesh to see it",)
    return notes
