"""Fast Fourier transforms (torch.fft: aten._fft_r2c, _fft_c2r, _fft_c2c), by the convention FFT
benchmarks state their rates in, FFTW's (benchFFT, http://www.fftw.org/speed/method.html): a
complex transform of N points (N the product of the transformed sizes) counts 5·N·log2(N) FLOPs,
the radix-2 Cooley-Tukey count; a real-data one (r2c, c2r) half of it, 2.5·N·log2(N). A convention,
not the kernel's own count (its radices and N's factors change that), rounded to a whole number
per transform. A normalization (norm="ortho" or the inverse's 1/N) scales every output element:
1 FLOP each, 2 for a complex element."""

import math

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten

_NONE = 0  # torch's fft_norm_mode: none, by_root_n, by_n (aten/src/ATen/native/SpectralOpsUtils.h)


def _transforms(shape, dim, complex_points: bool, normalization: int, out_elements: int, complex_out: bool) -> Flops:
    n = 1
    for d in dim:
        n *= shape[d]
    count = numel(shape) // n if n else 0
    per = (5 if complex_points else 2.5) * n * math.log2(n) if n > 1 else 0
    scale = out_elements * (2 if complex_out else 1) if normalization != _NONE else 0
    return Flops(other=round(per) * count + scale)


@register(aten._fft_r2c)
def fft_r2c(x_shape, dim, normalization, onesided, *, out_shape, ctx, **kwargs) -> Flops:
    return _transforms(x_shape, dim, False, normalization, numel(out_shape), True)


@register(aten._fft_c2r)
def fft_c2r(x_shape, dim, normalization, last_dim_size, *, out_shape, ctx, **kwargs) -> Flops:
    # the real side is the output: its sizes are the transform's points
    return _transforms(out_shape, dim, False, normalization, numel(out_shape), False)


@register(aten._fft_c2c)
def fft_c2c(x_shape, dim, normalization, forward, *, out_shape, ctx, **kwargs) -> Flops:
    return _transforms(x_shape, dim, True, normalization, numel(out_shape), True)
