#!/usr/bin/env bash
# gpu-check.sh: kvd's cuda backend on a machine with an NVIDIA GPU, in one run of a few minutes.
#
#   scripts/gpu-check.sh [--cpu-dry-run] [--out DIR] [--wheels DIR] [--python PY]
#                        [--big-pool-gib N] [--bench-pool-gib N] [--skip-bench] [--budget SECS]
#
# Steps; each runs even when an earlier one failed, and the exit status is 1 when any did:
#   env      Python, torch, cupy, NVML versions, the GPU and its free memory  -> env.txt
#   deps     kvd's requirements the machine does not meet, from wheels/ (pip --no-index)
#   install  kvd from this checkout with --no-deps into a scratch folder (on PYTHONPATH)
#   tests    pytest -m cuda tests/gpu: a pool's own allocation, export and zeroing, two
#            client processes writing and reading the same blocks, copy-on-write, a
#            100 GiB pool mapped by two clients, a real daemon with a cuda pool serving
#            two clients, a pool larger than free memory refused with nobody failing
#                                                                              -> gpu-tests.xml
#   bench    bench/gpu_dataplane.py: a client writing KV into its blocks beside a
#            device-to-device copy of the same size, same run                 -> dataplane.json
#   summary  every step's status and time, the test counts, the bench figures -> summary.json
# Everything printed also goes to gpu-check.log. Files land in $OUT when it is set (the
# device tool's folder: at most 8 files come back; this writes 5), else out/gpu-check/.
#
# Needs nothing from the network: wheels/ must hold the wheels (scripts/fetch-gpu-wheels.sh;
# with the device tool, carry=["wheels"]). Meant for Python 3.12 with torch, cupy-cuda13x,
# nvidia-ml-py, numpy, msgpack, anyio and pytest already installed.
#
# --cpu-dry-run runs the same steps on a machine without a GPU, to prove the plumbing:
# kvd's requirements resolved for cp312 from the wheels alone, into a scratch folder,
# kvd installed with --no-deps, the GPU tests collected and every one skipped with its
# reason, the bench on CPU tensors.

# The steps are functions called through `step NAME FUNCTION`, which shellcheck cannot follow.
# shellcheck disable=SC2317
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=0
OUT_DIR=${OUT:-$REPO/out/gpu-check}
WHEELS=$REPO/wheels
PY=""
BIG_POOL_GIB=100
BENCH_POOL_GIB=16
SKIP_BENCH=0
BUDGET=540   # seconds for the whole run; a device command may run 600

usage() { sed -n '2,31p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-dry-run) DRY=1; shift ;;
        --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        --big-pool-gib) BIG_POOL_GIB=${2:?}; shift 2 ;;
        --bench-pool-gib) BENCH_POOL_GIB=${2:?}; shift 2 ;;
        --skip-bench) SKIP_BENCH=1; shift ;;
        --budget) BUDGET=${2:?}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
for n in "$BUDGET" "$BIG_POOL_GIB" "$BENCH_POOL_GIB"; do
    case "$n" in
        ''|*[!0-9]*) echo "gpu-check: --budget and the pool sizes are whole numbers" >&2; exit 2 ;;
    esac
done

if [ -z "$PY" ]; then
    if [ "$DRY" = 1 ] && [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu-check: no Python at $PY" >&2
    exit 2
fi

mkdir -p "$OUT_DIR" || { echo "gpu-check: cannot create $OUT_DIR" >&2; exit 2; }
LOG=$OUT_DIR/gpu-check.log
: >"$LOG"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/kvd-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$SCRATCH"' EXIT
DEPS_SITE=$SCRATCH/deps
KVD_SITE=$SCRATCH/kvd
STEPS_FILE=$SCRATCH/steps.tsv
: >"$STEPS_FILE"

# PYTHONSAFEPATH: no process puts the working directory on sys.path, so kvd is imported
# from where the install step put it (and its checks mean something), in every process.
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONSAFEPATH=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1
export PYTHONPATH=""
export KVD_GPU_BIG_POOL_GIB=$BIG_POOL_GIB
# Other daemons' defaults must not leak in (tests pass their own configuration).
unset KVD_CONFIG KVD_ADDRESS

say() { printf '[gpu-check %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$LOG"; }

# Seconds left of the budget, less a margin for the summary.
left() { echo $((BUDGET - SECONDS - 20)); }

# bounded SECS CMD...: CMD with a time limit (never past the budget), its output logged.
bounded() {
    local limit=$1
    shift
    local remaining
    remaining=$(left)
    [ "$remaining" -lt "$limit" ] && limit=$remaining
    if [ "$limit" -le 5 ]; then
        say "no time left for: $*"
        return 124
    fi
    local rc
    if command -v timeout >/dev/null 2>&1; then
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
    else
        "$@" 2>&1 | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
    fi
    return "$rc"
}

# step NAME FUNCTION: run a step, record "name<TAB>status<TAB>seconds<TAB>note".
NOTE=""
step() {
    local name=$1 fn=$2 start=$SECONDS rc status
    NOTE=""
    say "== $name"
    "$fn"
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - start)) "$NOTE" >>"$STEPS_FILE"
    say "== $name: $status (${NOTE:-rc $rc}) in $((SECONDS - start)) s"
}

# kvd's runtime requirements (pyproject.toml). All but numpy are carried in wheels/, with
# what they need in turn; the machine's own copies are used when they are new enough.
# setup.py's build requirement besides setuptools (pyproject.toml's [build-system]).
BUILD_MYPY=mypy==2.4.1
REQUIREMENTS=("numpy>=1.26" "msgpack>=1.0.8" "pyzmq>=26" "anyio>=4.4" "structlog>=24.1"
              "prometheus-client>=0.20" "rich>=13")

# unsatisfied: the requirements the current interpreter (and PYTHONPATH) does not meet.
unsatisfied() {
    "$PY" - "${REQUIREMENTS[@]}" <<'EOF'
import importlib.metadata as md
import re
import sys
try:
    from packaging.requirements import Requirement
except ImportError:  # presence only
    Requirement = None
for spec in sys.argv[1:]:
    name = re.split(r"[<>=!~ ;]", spec, maxsplit=1)[0]
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        print(spec)
        continue
    if Requirement is not None and not Requirement(spec).specifier.contains(version, True):
        print(spec)
EOF
}

step_env() {
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "dry run: $DRY"
        echo "python: $PY"
        uname -srm
        "$PY" - <<'EOF'
import importlib.metadata as md
import sys
print("python", sys.version.split()[0], sys.executable)
for dist in ("torch", "cupy-cuda13x", "nvidia-ml-py", "numpy", "msgpack", "anyio", "pyzmq",
             "structlog", "prometheus-client", "rich", "pytest", "pytest-timeout", "setuptools"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
try:
    import torch
    print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        print(f"cuda:{i} {torch.cuda.get_device_name(i)} free {free / 2**30:.1f} GiB "
              f"of {total / 2**30:.1f} GiB")
except Exception as exc:
    print("torch cuda: unavailable", exc)
EOF
        if command -v nvidia-smi >/dev/null 2>&1; then
            nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,memory.free,driver_version \
                --format=csv 2>&1
        else
            echo "nvidia-smi: not found"
        fi
    } 2>&1 | tee "$OUT_DIR/env.txt" | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
}

step_deps() {
    local wheels
    wheels=$(find "$WHEELS" -maxdepth 1 -name '*.whl' 2>/dev/null | wc -l)
    if [ "$DRY" = 1 ]; then
        # Prove the carried set is complete: every requirement but numpy, resolved for
        # CPython 3.12 from the wheels alone.
        if [ "$wheels" -eq 0 ]; then
            NOTE="no wheels in $WHEELS: run scripts/fetch-gpu-wheels.sh"
            return 1
        fi
        local specs=() r platforms=() p
        for r in "${REQUIREMENTS[@]}" "$BUILD_MYPY"; do
            [ "${r%%[<>=]*}" = numpy ] || specs+=("$r")
        done
        for p in manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
                 manylinux2014_x86_64; do
            platforms+=(--platform "$p")
        done
        bounded 120 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" \
            --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
            --target "$SCRATCH/cp312" "${specs[@]}" || { NOTE="the wheels do not resolve"; return 1; }
        local n
        n=$(find "$SCRATCH/cp312" -maxdepth 1 -name '*.dist-info' | wc -l)
        NOTE="$n distributions install for cp312 from the wheels alone"
        return 0
    fi
    local missing=()
    mapfile -t missing < <(unsatisfied)
    if [ ${#missing[@]} -eq 0 ]; then
        NOTE="every requirement already met"
        return 0
    fi
    say "not met here: ${missing[*]}"
    case " ${missing[*]} " in
        *" numpy"*) NOTE="numpy is missing or too old, and it is not carried"; return 1 ;;
    esac
    if [ "$wheels" -eq 0 ]; then
        NOTE="${missing[*]} not met and no wheels in $WHEELS (scripts/fetch-gpu-wheels.sh; carry wheels)"
        return 1
    fi
    bounded 120 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" \
        --target "$DEPS_SITE" "${missing[@]}" || { NOTE="pip could not install ${missing[*]}"; return 1; }
    export PYTHONPATH=$DEPS_SITE
    local still=()
    mapfile -t still < <(unsatisfied)
    if [ ${#still[@]} -ne 0 ]; then
        NOTE="still not met after installing: ${still[*]}"
        return 1
    fi
    NOTE="installed ${missing[*]}"
}

step_install() {
    # Build from a copy, so that nothing is written into the checkout.
    local src=$SCRATCH/src
    mkdir -p "$src"
    # setup.py builds the C block hasher (optional: without a compiler or OpenSSL's
    # headers kvd installs with the Python hasher, which warns and is reported below)
    # and the mypyc-compiled engine (not optional: kvd.engine warns where it is missing).
    cp -R "$REPO/pyproject.toml" "$REPO/setup.py" "$REPO/README.md" "$REPO/kvd" "$REPO/client" \
        "$src/" || return 1
    find "$src" -name __pycache__ -type d -prune -exec rm -rf {} +
    find "$src" -name '*.so' -delete  # this machine's builds: the copy builds its own
    local deps=${PYTHONPATH:-}
    # setup.py has mypyc compile the engine: mypy for the build only, from the wheels
    # unless the interpreter has the pinned one (a dry run's .venv: the carried wheels
    # are cp312, and step deps proved they resolve).
    local tools=$SCRATCH/build-tools
    if "$PY" -c "import sys, mypy.version; sys.exit(mypy.version.__version__ != '${BUILD_MYPY#*==}')" \
            >/dev/null 2>&1; then
        say "$BUILD_MYPY: the interpreter's own"
    else
        bounded 120 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" \
            --target "$tools" "$BUILD_MYPY" || say "$BUILD_MYPY is not in $WHEELS: kvd cannot be built"
    fi
    if (export PYTHONPATH=$tools${deps:+:$deps}; bounded 300 "$PY" -m pip install --quiet \
            --no-index --no-deps --no-build-isolation --target "$KVD_SITE" "$src"); then
        export PYTHONPATH=$KVD_SITE${deps:+:$deps}
        NOTE="kvd installed with --no-deps"
    else
        export PYTHONPATH=$REPO:$REPO/client${deps:+:$deps}
        NOTE="pip could not build kvd here: using the checkout on PYTHONPATH"
        say "$NOTE"
    fi
    bounded 60 "$PY" -c "
import kvd, kvd_client, kvd.cli, kvd.memory.cuda, kvd_client.cuda, kvd_client.client
print('kvd', kvd.__version__, 'from', kvd.__file__)
print('kvd_client from', kvd_client.__file__)
from kvd_client.wire import hashing
print('block hasher:', hashing.IMPLEMENTATION)
import kvd.engine
print('engine compiled (mypyc):', kvd.engine.COMPILED)
" || { NOTE="$NOTE; kvd does not import"; return 1; }
}

step_tests() {
    local xml=$OUT_DIR/gpu-tests.xml
    rm -f "$xml"
    # -o pythonpath=: not the checkout (pyproject's pytest setting) but the install.
    (cd "$REPO" && bounded 420 "$PY" -m pytest -p no:cacheprovider -o pythonpath= -m cuda tests/gpu \
        -v -rs --junitxml="$xml")
    local rc=$?
    if [ ! -s "$xml" ]; then
        NOTE="pytest wrote no report (rc $rc)"
        return $((rc ? rc : 1))
    fi
    local counts
    counts=$("$PY" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
print(*(sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")))
EOF
    ) || { NOTE="unreadable report"; return 1; }
    local tests failures errors skipped
    read -r tests failures errors skipped <<<"$counts"
    NOTE="$tests tests: $((tests - failures - errors - skipped)) passed, $failures failed, $errors errors, $skipped skipped"
    if [ "$tests" -eq 0 ]; then
        NOTE="$NOTE (none collected)"
        return 1
    fi
    if [ "$DRY" = 1 ]; then
        # Without a GPU every test must skip cleanly, with its reason.
        [ "$((failures + errors))" -eq 0 ] && [ "$skipped" -eq "$tests" ] && return 0
        return 1
    fi
    if [ "$skipped" -eq "$tests" ]; then
        NOTE="$NOTE: no GPU was usable (see the skip reasons above)"
        return 1
    fi
    [ "$rc" -eq 0 ] && [ "$((failures + errors))" -eq 0 ]
}

step_bench() {
    if [ "$SKIP_BENCH" = 1 ]; then
        NOTE="skipped (--skip-bench)"
        return 0
    fi
    local json=$OUT_DIR/dataplane.json args=()
    rm -f "$json"
    if [ "$DRY" = 1 ]; then
        args=(--cpu --repeat 5)
    else
        args=(--pool-gib "$BENCH_POOL_GIB")
    fi
    (cd "$REPO" && bounded 240 "$PY" bench/gpu_dataplane.py "${args[@]}" --json "$json")
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        NOTE="the bench failed (rc $rc)"
        return "$rc"
    fi
    [ -s "$json" ] || { NOTE="the bench wrote no figures"; return 1; }
    NOTE="figures in dataplane.json"
}

say "kvd gpu-check: repo $REPO, out $OUT_DIR, python $PY, dry run $DRY, budget ${BUDGET} s"
step env step_env
step deps step_deps
step install step_install
step tests step_tests
step bench step_bench

"$PY" - "$STEPS_FILE" "$OUT_DIR" "$DRY" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
steps_file, out, dry = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
steps = []
for line in Path(steps_file).read_text().splitlines():
    name, status, seconds, note = (line.split("\t") + [""])[:4]
    steps.append({"step": name, "status": status, "seconds": int(seconds), "note": note})
summary = {"dry_run": dry, "ok": all(s["status"] == "ok" for s in steps), "steps": steps}
bench = out / "dataplane.json"
if bench.is_file():
    figures = json.loads(bench.read_text())
    summary["dataplane"] = {
        "mode": figures.get("mode"),
        "gpu": figures.get("gpu"),
        "bytes_written_per_run": figures.get("bytes_written_per_run"),
        "cases": figures.get("cases"),
    }
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print()
print(f"{'step':<8} {'status':<8} {'s':>4}  note")
for s in steps:
    print(f"{s['step']:<8} {s['status']:<8} {s['seconds']:>4}  {s['note']}")
if "dataplane" in summary and summary["dataplane"]["cases"]:
    print(f"\n{'case':<12} {'GB/s':>8} {'vs d2d':>7}   ({summary['dataplane']['mode']}, "
          f"{summary['dataplane']['gpu'] or 'cpu'})")
    for name, c in summary["dataplane"]["cases"].items():
        print(f"{name:<12} {c['gb_per_s']:>8.1f} {c.get('vs_d2d', 1.0):>7.3f}")
print("\nall steps ok" if summary["ok"] else "\nSOME STEPS FAILED")
sys.exit(0 if summary["ok"] else 1)
EOF
exit "${PIPESTATUS[0]}"
