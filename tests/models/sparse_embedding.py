"""An embedding with sparse gradients (nn.Embedding(sparse=True)): fxacct accounts strided tensors only."""
import torch
import torch.nn as nn


class SparseEmbedding(nn.Module):
    def __init__(self, sparse: bool = True):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=sparse)

    def forward(self, idx):
        return self.emb(idx)

    def example_inputs(self, batch):
        return (torch.randint(0, 10, (batch, 3)),)
