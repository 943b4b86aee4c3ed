"""examples/llama.py's Llama parallelized with FSDP2 under a MixedPrecisionPolicy: parameters
gathered in bf16 (so the matmuls run in bf16), gradients reduced in fp32; tensor parallel first on
the mesh's ``tp`` dimension, as examples/llama.py:parallelize does.

    fxacct profile examples/llama.py:Llama --mesh fsdp=2,tp=2 --gpu h100 \\
        --parallelize tests/models/llama_mixed_precision.py:parallelize
"""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from examples.llama import tp_plan

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model, mesh):
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        root, block = tp_plan()
        parallelize_module(model, mesh["tp"], root)
        for layer in model.layers.values():
            parallelize_module(layer, mesh["tp"], block)
    if "fsdp" in names:
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["fsdp"], mp_policy=POLICY)
        fully_shard(model, mesh=mesh["fsdp"], mp_policy=POLICY, reshard_after_forward=False)
    return model
