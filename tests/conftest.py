"""Shared test set-up: Hypothesis profiles and a meta-device model builder.

Profiles: ``ci`` (derandomized, so a CI failure reproduces exactly) is loaded when the ``CI``
environment variable is set; ``dev`` otherwise. A test that needs fewer examples says so with its
own ``@settings``.
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TESTS)):  # `examples` and the test helpers import from any cwd
    if p not in sys.path:
        sys.path.insert(0, p)

from helpers import on_meta  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def meta():
    """``meta(cls_or_factory, *args, **kwargs)``: build a model on the meta device (no memory).

    Session-scoped so Hypothesis tests may use it (it holds no state)."""
    return on_meta


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
