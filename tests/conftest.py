"""Shared test set-up: Hypothesis profiles, an isolated cache dir for every test, and a meta-device
model builder.

Profiles: ``ci`` (derandomized, so a CI failure reproduces exactly) is loaded when the ``CI``
environment variable is true (GitHub Actions and most CI services set ``CI=true``); ``dev``
otherwise. A test that needs fewer examples says so with its own ``@settings``.

Cache: fxacct keeps device calibrations in ``$FXACCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxacct``,
else ``~/.cache/fxacct`` (fxacct.predict.calibration). No test may read or write the user's: a
session-wide empty cache covers module- and session-scoped fixtures, and each test gets its own
empty one on top. Subprocesses inherit ``os.environ``; a test that passes ``env=`` must build it
from ``os.environ``.
"""

import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

import fxacct.heap

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TESTS)):  # `examples` and the test helpers import from any cwd
    if p not in sys.path:
        sys.path.insert(0, p)

from helpers import on_meta  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")

def _point_cache_at(mp: pytest.MonkeyPatch, folder: Path) -> Path:
    mp.setenv("FXACCT_CACHE_DIR", str(folder / "fxacct-cache"))
    mp.setenv("XDG_CACHE_HOME", str(folder / "xdg-cache"))
    return folder / "fxacct-cache"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """An empty cache for what runs outside a test: session- and module-scoped fixtures."""
    with pytest.MonkeyPatch.context() as mp:
        yield _point_cache_at(mp, tmp_path_factory.mktemp("session-cache"))


@pytest.fixture(autouse=True)
def cache_dir(_session_cache, tmp_path_factory, monkeypatch) -> Path:
    """This test's own empty fxacct cache dir (not created; fxacct.predict.calibration.save makes it),
    outside ``tmp_path`` so a test that lists its tmp_path finds only its own files."""
    return _point_cache_at(monkeypatch, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def meta():
    """``meta(cls_or_factory, *args, **kwargs)``: build a model on the meta device (no memory).

    Session-scoped so Hypothesis tests may use it (it holds no state)."""
    return on_meta


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def one_command_process(monkeypatch):
    """This process as the CLI's (fxacct.heap.one_command_process: its collector off for good), for
    the test; the collector and the module's state back as they were after it."""
    monkeypatch.setattr(fxacct.heap, "_one_command", False)
    fxacct.heap.one_command_process()
    try:
        yield
    finally:
        gc.enable()
