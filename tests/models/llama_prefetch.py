"""examples/llama.py's Llama under FSDP2 with explicit forward prefetching two blocks ahead
(``set_modules_to_forward_prefetch``, torch/distributed/fsdp/_fully_shard/_fully_shard.py), as
torchtitan's ``fsdp_forward_prefetch`` does.

    fxacct profile examples/llama.py:Llama -k n_layers=4 --mesh fsdp=2 --gpu h100 \\
        --parallelize tests/models/llama_prefetch.py:parallelize
"""

from examples.llama import parallelize as fsdp_parallelize


def parallelize(model, mesh):
    model = fsdp_parallelize(model, mesh)
    layers = list(model.layers.values())
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
    return model
