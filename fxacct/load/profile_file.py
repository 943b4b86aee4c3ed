"""Reading a profile JSON file back (`fxacct profile --format json`, schema fxacct.profile/N):
`fxacct diff` and `fxacct estimate train-time --from` take one. Every way a file can be wrong is a
one-line UsageError that names the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from fxacct.errors import UsageError

SCHEMA_PREFIX = "fxacct.profile/"
# the versions this fxacct reads: its own (fxacct.report.document.SCHEMA; tests/test_check_diff.py
# holds it among them)
READS = ("fxacct.profile/1",)


def read_profile(path: str) -> dict:
    """The document in ``path``, checked to be an fxacct profile (any schema version)."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{path} is a directory: give a file written by fxacct profile --format json")
    if not file.is_file():
        raise UsageError(f"{path}: no such file; write one with fxacct profile MODEL --format json -o {path}")
    try:
        doc = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file: give a file written by fxacct profile --format json") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                         "give a file written by fxacct profile --format json") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        raise UsageError(f"{path} is not an fxacct profile (no \"schema\": \"{SCHEMA_PREFIX}N\"): "
                         "write it with fxacct profile --format json")
    if schema not in READS:  # a later version's keys may mean other things
        raise UsageError(f"{path} has schema {schema}, which this fxacct does not read (it reads "
                         f"{', '.join(READS)}): profile it again with this fxacct")
    if not isinstance(doc.get("totals"), dict):
        raise UsageError(f"{path} has no \"totals\" object: write it with fxacct profile --format json")
    return doc


def same_schema(old: dict, new: dict, old_path: str, new_path: str) -> None:
    if old["schema"] != new["schema"]:
        raise UsageError(f"{old_path} has schema {old['schema']} but {new_path} has {new['schema']}: "
                         "profile both with the same fxacct version before comparing")
