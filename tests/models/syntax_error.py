"""A model file that does not parse (a missing colon): loading it must fail with exit 3."""
import torch.nn as nn


class Broken(nn.Module)
    def forward(self, x):
        return x
