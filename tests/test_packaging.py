"""The wheel must carry every package of the source tree (a non-editable install imports from it)."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fxacct").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
    assert config["package-dir"]["fxacct_cli"] == "cli" and "fxacct_cli" in listed
