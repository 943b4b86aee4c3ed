"""A small CNN for 32×32 images (CIFAR-10 sized): three Conv-BatchNorm-ReLU-MaxPool stages, then
dropout and a linear classifier. Many small ops, little arithmetic per op: the kind of model whose
step time on a CPU or a GPU is mostly per-op overhead rather than FLOPs (issue 10).

    fxacct profile examples/cnn.py:CNN --batch 32
    fxacct profile examples/cnn.py:CNN --batch 32 --runtime --device cpu

At the defaults (widths 16, 32, 64; 10 classes) it has 33,946 parameters: convolutions 3·16·9 +
16·32·9 + 32·64·9 = 23,472, BatchNorms 2·(16 + 32 + 64) = 224, fc 64·4·4·10 + 10 = 10,250.
"""

import torch
import torch.nn as nn


class ConvBlock(nn.Sequential):
    """3×3 convolution (no bias: the BatchNorm has one), BatchNorm, ReLU, 2×2 max-pool (halves the side)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2))


class CNN(nn.Module):
    def __init__(self, num_classes: int = 10, widths: tuple = (16, 32, 64), image_size: int = 32,
                 dropout: float = 0.25):
        super().__init__()
        self.image_size = image_size
        channels = (3,) + tuple(widths)
        self.features = nn.Sequential(*(ConvBlock(a, b) for a, b in zip(channels, channels[1:])))
        side = image_size // 2 ** len(widths)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels[-1] * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.features(x), 1)
        return self.fc(self.dropout(x))

    def example_inputs(self, batch: int):
        return (torch.randn(batch, 3, self.image_size, self.image_size),)
