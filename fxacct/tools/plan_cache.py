"""The planner's traces on disk, for reruns: one small JSON file per traced per-rank shape.

A file holds one Point or PipePoint (fxacct.tools.plan_screen), named by a SHA-256 of everything
that changes the trace: the layout's whole Config (mesh, micro-batch, checkpointing, dtype,
optimizer, GPU, ...), how much of the model was traced (the screen's block count), the bytes of
every file the Config names (the model's ``PATH.py``, the ``--parallelize`` and ``--pp-split``
files, ``--costs``, a Hugging Face directory's configs), fxacct's own source and the torch
version. Change any of them and the name changes: a stale file is never read, only left behind.

The directory is ``plan/`` in fxacct's cache (fxacct.predict.calibration.cache_dir:
``$FXACCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxacct``, else ``~/.cache/fxacct``); it holds
nothing else, so deleting it is always safe. A file that cannot be read or written is a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from fxacct.predict.calibration import cache_dir
from fxacct.tools.plan_screen import PipePoint, Point

KINDS = {"point": Point, "pipe": PipePoint}
_FXACCT = Path(__file__).resolve().parents[1]  # the fxacct package


def default_cache_dir() -> Path:
    return cache_dir() / "plan"


def _file_digest(path: Path, h) -> None:
    try:
        h.update(path.read_bytes())
    except OSError:
        h.update(b"?")


def _named_files(value) -> list[Path]:
    """Files a Config string names: ``PATH.py:Name`` / ``PATH.py``, ``hf:DIR`` (its .json and .py)."""
    if isinstance(value, (tuple, list)):
        return [p for v in value for p in _named_files(v)]
    if not isinstance(value, str):
        return []
    if value.startswith("hf:"):
        d = Path(value[3:])
        return sorted(p for p in d.glob("*") if p.suffix in (".json", ".py")) if d.is_dir() else []
    head = value.rsplit(":", 1)[0] if ":" in value else value
    return [Path(head)] if head.endswith(".py") and Path(head).is_file() else []


def _source_digest() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(_FXACCT.rglob("*.py")):
        h.update(str(path.relative_to(_FXACCT)).encode())
        _file_digest(path, h)
    return h.hexdigest()


class TraceCache:
    """get(config, part) and put(config, part, value) of one plan's traces under ``root``;
    ``part``: what else names the trace (its kind and block count)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.source = _source_digest()

    def _path(self, config, part) -> Path:
        h = hashlib.sha256(self.source.encode())
        h.update(repr(config).encode())
        h.update(repr(part).encode())
        for f in dataclasses.fields(config):
            for path in _named_files(getattr(config, f.name)):
                h.update(str(path).encode())
                _file_digest(path, h)
        return self.root / f"{h.hexdigest()}.json"

    def get(self, config, part):
        try:
            doc = json.loads(self._path(config, part).read_text())
            cls = KINDS[doc.pop("kind")]
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, config, part, value) -> None:
        kind = next(k for k, cls in KINDS.items() if isinstance(value, cls))
        path = self._path(config, part)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.root, suffix=".tmp", delete=False) as f:
                json.dump({"kind": kind, **dataclasses.asdict(value)}, f)
            os.replace(f.name, path)  # atomic: a parallel worker reads the whole file or none
        except OSError:
            pass


__all__ = ["TraceCache", "default_cache_dir"]
