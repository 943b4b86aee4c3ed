"""examples/llama.py's Llama with its blocks in a ModuleList (block replay finds runs in
ModuleLists and Sequentials, not in ModuleDicts), and its torchtitan-style ``parallelize``."""

import importlib.util
from pathlib import Path

import torch.nn as nn

_spec = importlib.util.spec_from_file_location("llama_example", Path(__file__).resolve().parents[2] / "examples/llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)


class ListLlama(llama.Llama):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.layers = nn.ModuleList(self.layers.values())

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def parallelize(model, mesh, sequence_parallel=False):
    """examples/llama.py's parallelize over a ModuleList: TP on ``tp``, then FSDP2 on ``fsdp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        root, block = llama.tp_plan(sequence_parallel)
        parallelize_module(model, mesh["tp"], root)
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], block)
    if "fsdp" in names:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"], reshard_after_forward=False)
    return model


def parallelize_sp(model, mesh):
    return parallelize(model, mesh, sequence_parallel=True)
