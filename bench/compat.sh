#!/usr/bin/env bash
# Which torch releases fxacct works on: a venv per release, fxacct installed into it with its test
# extras, a test selection run, and a table release x pass/fail with counts.
#
#   bench/compat.sh                         every release in RELEASES below
#   bench/compat.sh 2.13.0 2.15.0           only these
#   bench/compat.sh --install-only 2.8.0    make the venvs, run nothing (downloads ahead of a run)
#
# Environment:
#   COMPAT_DIR    venvs, logs, junit files and the table (default /tmp/fxacct-compat; outside the repo)
#   COMPAT_TESTS  the pytest arguments (default: the selection below); COMPAT_TESTS=fast runs the
#                 whole fast tier (-m "not slow"), about 4x as long
#   PYTHON        the interpreter the venvs are made from (default python3)
#
# Every release after the CPU wheel on this machine's disk comes from the registry as a CUDA build
# with its nvidia packages (about 6 GB a venv); it runs on the CPU. A venv that already holds the
# release is reused. Each row also runs the mesh acceptance command, `fxacct profile
# examples/llama.py:Llama --batch 2 --mesh fsdp=2,tp=2 --parallelize examples/llama.py:parallelize`,
# and records its exit code. docs/compat.md has the last table and how long a run takes.
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
COMPAT_DIR=${COMPAT_DIR:-/tmp/fxacct-compat}
PYTHON=${PYTHON:-python3}
# from the floor pyproject once declared (torch>=2.4) to the newest release the registry serves
RELEASES="2.4.1 2.6.0 2.8.0 2.10.0 2.12.1 2.13.0 2.14.1 2.15.0"
# the formula tier, every mesh and pipeline test, the private-API pins and a few single-device files
SELECTION="tests/test_formulas.py tests/test_parallel_*.py tests/test_torch_private.py tests/test_capture.py
           tests/test_estimate.py tests/test_memory_acceptance.py tests/test_replay.py tests/test_aliasing.py"

install_only=0
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi
[ $# -gt 0 ] && RELEASES="$*"
mkdir -p "$COMPAT_DIR"

installed_release() {  # the torch version a venv holds, without a local label; empty if none
    "$1/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null
}

install() {  # venv release -> 0 when the venv holds that release
    local venv=$1 release=$2
    [ "$(installed_release "$venv")" = "$release" ] && return 0
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || return 1
    "$venv/bin/pip" install --quiet --no-cache-dir "torch==$release" -e "$ROOT[test]" \
        >"$COMPAT_DIR/torch-$release.install.log" 2>&1 || return 1
    [ "$(installed_release "$venv")" = "$release" ]
}

counts() {  # junit xml -> "passed failed errors skipped"
    "$PYTHON" - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("- - - -"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
t, f, e, s = (sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped"))
print(t - f - e - s, f, e, s)
EOF
}

table="$COMPAT_DIR/table.md"
tmp="$table.$$"
{
    echo "| torch | result | passed | failed | errors | skipped | mesh profile exit | minutes |"
    echo "|---|---|---|---|---|---|---|---|"
} >"$tmp"

for release in $RELEASES; do
    venv="$COMPAT_DIR/torch-$release"
    start=$(date +%s)
    echo "== torch $release: installing into $venv" >&2
    if ! install "$venv" "$release"; then
        echo "| $release | install failed (see torch-$release.install.log) | - | - | - | - | - | - |" >>"$tmp"
        continue
    fi
    [ $install_only = 1 ] && continue
    # fxacct's package and its CLI import on this release, or the row says why not
    if ! why=$(cd "$ROOT" && "$venv/bin/python" -c "import fxacct, fxacct_cli.main" 2>&1); then
        echo "| $release | fxacct does not import: $(echo "$why" | tail -n 1 | tr '|' '/') | - | - | - | - | - | - |" \
            >>"$tmp"
        continue
    fi
    echo "== torch $release: testing" >&2
    xml="$COMPAT_DIR/torch-$release.xml"
    rm -f "$xml"
    if [ "${COMPAT_TESTS:-}" = fast ]; then args="tests"; else args=${COMPAT_TESTS:-$SELECTION}; fi
    # shellcheck disable=SC2086  # the selection is a list of globs
    (cd "$ROOT" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" --junitxml="$xml" $args) \
        >"$COMPAT_DIR/torch-$release.log" 2>&1
    rc=$?
    (cd "$ROOT" && "$venv/bin/python" -m fxacct profile examples/llama.py:Llama --batch 2 --mesh fsdp=2,tp=2 \
        --parallelize examples/llama.py:parallelize) >"$COMPAT_DIR/torch-$release.mesh.log" 2>&1
    mesh=$?
    read -r passed failed errors skipped <<<"$(counts "$xml")"
    if [ $rc = 0 ] && [ $mesh = 0 ]; then result=pass; elif [ "$passed" = - ]; then result="no tests ran (exit $rc)";
    else result=fail; fi
    minutes=$(( ($(date +%s) - start + 30) / 60 ))
    echo "| $release | $result | $passed | $failed | $errors | $skipped | $mesh | $minutes |" >>"$tmp"
    tail -n 1 "$tmp" >&2
done

[ $install_only = 1 ] && { rm -f "$tmp"; exit 0; }
mv "$tmp" "$table"
echo "torch releases x fxacct ($(date -u +%Y-%m-%d), $(git -C "$ROOT" rev-parse --short HEAD)), logs in $COMPAT_DIR:"
cat "$table"
# exit 0 only when every release passed
! awk -F"|" 'NR > 2 && $3 != " pass "' "$table" | grep -q .
