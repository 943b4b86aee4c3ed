"""Mutation check of the cost formulas: every integer literal >= 2 in fxacct/costs/*.py, one at a
time, is raised by 1 in a temporary copy of the repository, and tests/test_formulas.py must fail.

Usage: python bench/mutate_costs.py   (prints each surviving mutation; exit 1 if any survive)

Every literal is covered, none skipped: a literal whose change no test notices is either a constant
that is not checked or dead code, and both should be fixed rather than excused.
"""

import ast
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COSTS = "fxacct/costs"
TEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_formulas.py"]


def literals(source: str):
    """(line, col, end_col, value) of every int literal >= 2 (bools excluded)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 2:
            yield node.lineno, node.col_offset, node.end_col_offset, node.value


def mutate(source: str, line: int, col: int, end: int, value: int) -> str:
    lines = source.splitlines(keepends=True)
    text = lines[line - 1]
    lines[line - 1] = text[:col] + str(value + 1) + text[end:]
    return "".join(lines)


def run_tests(copy: Path) -> int:
    """pytest's exit status on the copy: 0 all passed (the mutant survived), 1 a test failed."""
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"}  # the copy's fxacct, not the install
    return subprocess.run([sys.executable, *TEST], cwd=copy, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


def main() -> int:
    start = time.time()
    survivors, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info"))
        for path in sorted((copy / COSTS).glob("*.py")):
            original = path.read_text()
            for line, col, end, value in literals(original):
                total += 1
                path.write_text(mutate(original, line, col, end, value))
                try:
                    rc = run_tests(copy)
                finally:
                    path.write_text(original)
                where = f"{COSTS}/{path.name}:{line}:{col}  {value} -> {value + 1}"
                if rc == 0:
                    survivors.append(where)
                    print("SURVIVED", where, flush=True)
                elif rc != 1:  # 2-4: collection or import error; still a failure, but say so
                    print(f"killed (pytest exit {rc})", where, flush=True)
        clean = run_tests(copy)  # the unmutated copy must pass, or every "kill" means nothing
    print(f"{total} mutants, {total - len(survivors)} killed, {len(survivors)} survived; "
          f"unmutated run exit {clean}; {time.time() - start:.0f} s")
    return 1 if survivors or clean != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
