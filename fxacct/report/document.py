"""The JSON document of the contract in ../shared/DESIGN.md (schema fxacct.profile/1).

Keys never change meaning; figures are exact integers. Figures another part of fxacct has not
computed for this profile are null, never a made-up 0.
"""

from __future__ import annotations

from fxacct.costs.registry import FLOP_CLASSES, Flops
from fxacct.dtypes import dtype_name
from fxacct.profile import Profile
from fxacct.units import FLOPS_PER_FMA

SCHEMA = "fxacct.profile/1"


def _by_class(f: Flops) -> dict[str, int]:
    return {k: v for k, v in f.as_dict().items() if k in FLOP_CLASSES}


def document(p: Profile) -> dict:
    a, c, t = p.accounting, p.config, p.accounting.totals
    return {
        "schema": SCHEMA,
        "model": c.target,
        "config": {
            "batch": c.batch, "dtype": dtype_name(c.dtype) if c.dtype is not None else None,
            "amp": c.amp, "optimizer": c.optimizer, "gpu": c.gpu, "world_size": c.world_size,
            "shard": c.shard, "tokens_per_example": t.tokens_per_example, "inputs": list(a.input_shapes),
        },
        "conventions": {"flops_per_fma": FLOPS_PER_FMA, "causal_attention": c.causal_attention},
        "totals": {
            "forward_flops": t.forward.total, "backward_flops": t.backward.total, "loss_flops": t.loss_flops,
            "forward_flops_by_class": _by_class(t.forward), "backward_flops_by_class": _by_class(t.backward),
            "params": t.params, "trainable_params": t.trainable_params,
            "param_bytes": t.param_bytes, "grad_bytes": t.grad_bytes, "optimizer_bytes": None,
            "activation_bytes": t.activation_bytes, "peak_train_bytes": None, "peak_inference_bytes": None,
            "predicted_step_ms": None,
        },
        "by_dtype": {
            dt: {"param_bytes": d.param_bytes, "grad_bytes": d.grad_bytes, "optimizer_bytes": None,
                 "activation_bytes": d.activation_bytes}
            for dt, d in a.by_dtype.items()
        },
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
    }
