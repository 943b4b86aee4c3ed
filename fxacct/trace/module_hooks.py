"""Global forward hooks on every module, for the length of a context (public torch API)."""

from __future__ import annotations

import contextlib

import torch

from fxacct.errors import called_by_torch


@contextlib.contextmanager
def global_module_hooks(pre, post):
    """``pre(module, args)`` before and ``post(module, args, output)`` after every module's forward,
    ``post`` even when the forward raises; both removed on exit."""
    h_pre = torch.nn.modules.module.register_module_forward_pre_hook(called_by_torch(pre))
    h_post = torch.nn.modules.module.register_module_forward_hook(called_by_torch(post), always_call=True)
    try:
        yield
    finally:
        h_pre.remove()
        h_post.remove()
