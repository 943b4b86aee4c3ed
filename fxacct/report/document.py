"""The JSON document of the contract in ../shared/DESIGN.md (schema fxacct.profile/1).

Keys never change meaning; figures are exact integers. Figures another part of fxacct has not
computed for this profile are null, never a made-up 0.
"""

from __future__ import annotations

from fxacct.costs.registry import FLOP_CLASSES, Flops
from fxacct.dtypes import dtype_name
from fxacct.report.checkpoint_text import checkpoint_json
from fxacct.report.collectives import add_to_document
from fxacct.report.compile_text import compile_json
from fxacct.report.runtime_json import predicted
from fxacct.report.runtime_json import runtime as runtime_json
from fxacct.step import Profile
from fxacct.units import FLOPS_PER_FMA

SCHEMA = "fxacct.profile/1"


def _by_class(f: Flops) -> dict[str, int]:
    return {k: v for k, v in f.as_dict().items() if k in FLOP_CLASSES}


def document(p: Profile, prediction=None, runtime=None) -> dict:
    """``prediction``: a fxacct.predict.roofline.Prediction (fills ``totals.predicted_step_ms`` and adds
    ``predicted``); ``runtime``: a fxacct.runtime.RuntimeResult (adds ``runtime``)."""
    doc = add_to_document(_document(p), p.parallel)
    if prediction is not None:
        if p.parallel is None or p.parallel.time is None:  # under --mesh: the critical path (add_to_document)
            doc["totals"]["predicted_step_ms"] = prediction.step_ms
        doc["predicted"] = predicted(prediction)
    if runtime is not None:
        doc["runtime"] = runtime_json(runtime)
    return doc


def _document(p: Profile) -> dict:
    a, c, t, m = p.accounting, p.config, p.accounting.totals, p.memory
    return {
        "schema": SCHEMA,
        "model": c.target,
        "model_class": p.model_class,
        "config": {
            "batch": c.batch, "dtype": dtype_name(c.dtype) if c.dtype is not None else None,
            "amp": dtype_name(c.amp) if c.amp is not None else None, "optimizer": c.optimizer, "gpu": c.gpu, "world_size": c.world_size,
            "shard": c.shard, "tokens_per_example": t.tokens_per_example, "inputs": list(a.input_shapes),
            "master_weights": c.master_weights, "loss": c.loss, "fp8": c.fp8, "zero1": c.zero1,
        },
        "conventions": {"flops_per_fma": FLOPS_PER_FMA, "causal_attention": c.causal_attention,
                        "recompute": "counted" if c.count_recompute else "excluded"},
        "totals": {
            "forward_flops": t.forward.total, "backward_flops": t.backward.total, "loss_flops": t.loss_flops,
            "forward_flops_by_class": _by_class(t.forward), "backward_flops_by_class": _by_class(t.backward),
            "params": t.params, "trainable_params": t.trainable_params,
            "param_bytes": t.param_bytes, "grad_bytes": t.grad_bytes, "optimizer_bytes": m.optimizer_bytes,
            "activation_bytes": t.activation_bytes, "loss_activation_bytes": t.loss_activation_bytes,
            "peak_train_bytes": m.rank_peak.bytes if m.rank_peak is not None else None,
            "peak_reserved_bytes": m.reserved.peak_reserved_bytes if m.reserved is not None else None,
            "peak_inference_bytes": m.peak_inference.bytes if m.peak_inference is not None else None,
            "predicted_step_ms": None,
            "master_weight_bytes": m.master_bytes, "optimizer_flops": t.optimizer_flops,
            "recompute_flops": t.recompute_flops,
            "checkpoint_bytes": m.checkpoint_bytes,
        },
        "by_dtype": {
            dt: {"param_bytes": d.param_bytes, "grad_bytes": d.grad_bytes, "optimizer_bytes": d.optimizer_bytes,
                 "activation_bytes": d.activation_bytes, "master_weight_bytes": d.master_bytes}
            for dt, d in m.by_dtype.items()
        },
        "memory": _memory(p),
        "modules": [
            {"module": m.module, "forward_flops": m.forward.total, "backward_flops": m.backward.total,
             "activation_bytes": m.activation_bytes}
            for m in a.modules
        ],
        "nodes": [
            {"name": n.name, "op": n.op, "module": n.module, "shape": list(n.shape), "dtype": n.dtype,
             "forward_flops": n.forward.total, "backward_flops": n.backward.total,
             "activation_bytes": n.activation_bytes, "output_bytes": n.output_bytes, "kind": n.kind}
            for n in a.nodes
        ],
        "unsupported_ops": dict(a.unsupported_ops),
        "warnings": list(p.warnings),
        "checkpoint": checkpoint_json(p.checkpoint),
        "compile": compile_json(p.compiled),
    }


def _peak(pk) -> dict | None:
    if pk is None:
        return None
    return {"bytes": pk.bytes, "node": pk.node, "phase": pk.phase, "by_category": dict(pk.by_category)}


def _memory(p: Profile) -> dict:
    m = p.memory
    return {
        "peak_train": _peak(m.peak_train), "peak_inference": _peak(m.peak_inference),
        "per_rank": _peak(m.per_rank),
        "gathered_unit": {"module": m.gathered_unit[0], "bytes": m.gathered_unit[1]} if m.gathered_unit else None,
        "checkpoint_by_dtype": dict(m.checkpoint_by_dtype),
        "views": {"view_nodes": m.views.view_nodes, "bytes_avoided": m.views.bytes_avoided,
                  "copies": [{"op": op, "nodes": n, "bytes": b} for op, n, b in m.views.copies]},
        "fit": None if m.fit is None else {
            "gpu": m.fit.gpu, "capacity_bytes": m.fit.capacity_bytes, "peak_bytes": m.fit.peak_bytes,
            "headroom_bytes": m.fit.headroom_bytes, "max_batch": m.fit.max_batch,
            "max_batch_verified": m.fit.max_batch_verified, "basis": m.fit.basis},
        "reserved": _reserved(m.reserved),
        "fixed": None if m.reserved is None else [
            {"name": f.name, "bytes": f.bytes, "inside_reserved": f.inside_reserved, "source": f.source}
            for f in m.reserved.fixed],
    }


def _reserved(r) -> dict | None:
    """The step through the CUDA caching allocator (fxacct.memory.reserved), null on a CPU target."""
    if r is None:
        return None
    return {"peak_reserved_bytes": r.peak_reserved_bytes, "peak_allocated_bytes": r.peak_allocated_bytes,
            "by_pool_stream": [{"pool": pool, "stream": stream, "bytes": b} for pool, stream, b in r.by_pool_stream],
            "alloc_conf": r.alloc_conf, "expandable_segments": r.expandable_segments,
            "fixed_outside_bytes": r.fixed_outside_bytes, "fit_bytes": r.fit_bytes,
            "capacity_bytes": r.capacity_bytes, "alloc_retries": r.alloc_retries, "oom_events": r.oom_events}
