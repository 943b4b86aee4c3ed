"""--costs file for tests/models/custom_op_model.py: the formula of fxacct_test::squared_mm
(the model file defines the op; --costs files load after the model)."""

import torch

from fxacct.costs import Flops, register


@register(torch.ops.fxacct_test.squared_mm)
def squared_mm(x, w, *, out_shape, ctx, **kwargs):
    (m, k), (_, n) = x, w
    return Flops(matmul=2 * m * k * n, other=m * n)  # the product, then one square per output
