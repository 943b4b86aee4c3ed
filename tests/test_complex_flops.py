"""Complex arithmetic and FFTs in a model (a Fourier neural operator's spectral layer): a complex
multiply-add is 4 real multiplies and 4 real adds, 8 FLOPs where a real one is 2, so a complex
product counts 4x the real formula (FlopCounterMode counts it as real: 4x low); the FFTs count by
FFTW's convention (fxacct.costs.spectral). Both were uncosted or undercounted before."""

from __future__ import annotations

import torch

import fxacct


class SpectralLayer(torch.nn.Module):
    """rfft over the last axis, a complex weight per kept mode (einsum over channels), irfft."""

    def __init__(self, channels: int = 8, modes: int = 5):
        super().__init__()
        self.modes = modes
        self.w = torch.nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat))

    def forward(self, x):
        spectrum = torch.fft.rfft(x)  # [B, C, 16] -> [B, C, 9]
        mixed = torch.einsum("bix,iox->box", spectrum[..., :self.modes], self.w)
        return torch.fft.irfft(mixed, n=x.shape[-1])


def test_a_spectral_layer_counts_its_complex_products_and_its_transforms():
    B, C, L, M = 4, 8, 16, 5
    p = fxacct.profile_module(SpectralLayer(C, M), (torch.randn(B, C, L),), {}, fxacct.Config(batch=B))
    forward = p.accounting.totals.forward
    assert p.accounting.unsupported_ops == {}
    assert forward.matmul == 8 * B * C * C * M  # B·O·M outputs, C complex multiply-adds each, 8 FLOPs
    rfft = round(2.5 * L * 4) * B * C  # 2.5·N·log2(N), N = 16, per row
    irfft = rfft + B * C * L  # and its 1/N per output element
    assert forward.other == rfft + irfft


def test_a_real_product_is_unchanged():
    x, w = torch.randn(4, 8), torch.nn.Linear(8, 3, bias=False)
    p = fxacct.profile_module(w, (x,), {}, fxacct.Config(batch=4))
    assert p.accounting.totals.forward.matmul == 2 * 4 * 8 * 3
