"""A module with no example_inputs method and no module-level example_inputs function."""
import torch.nn as nn


class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, bias=False)  # 6 parameters

    def forward(self, x):
        return self.lin(x)
