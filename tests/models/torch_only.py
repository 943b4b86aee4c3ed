"""Models made entirely of torch's own modules, named in the model file: a failure inside them is
still the model's (exit 3), though no frame of this file is on the traceback."""
import torch
import torch.nn as nn

# fxacct profile tests/models/torch_only.py:Linear -k in_features=-1 -k out_features=2:
# nn.Linear's constructor fails inside torch
Linear = nn.Linear


def make_sequential():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def example_inputs(batch):
    return (torch.randn(batch, 5),)  # 5 features where the first Linear takes 3: a shape error in torch
