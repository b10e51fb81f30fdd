#!/usr/bin/env bash
# Build .bench-venv: vLLM 0.33.0's real KV-cache manager beside kvd, in one interpreter,
# so bench/vs_vllm.py, bench/daemon.py and bench/replay.py can time both in the same run.
#
# Never in CI (about 3 GB). Idempotent: re-running only installs what is missing.
#
# Why not `pip install vllm`: its dependency list pins a CUDA torch (several GB) and
# kernels we never call. We install torch 2.13.0 (the CPU wheel this machine serves
# quickly) first, vllm itself with --no-deps, then exactly the packages that the import
# chain of vllm.v1.core.{kv_cache_manager,block_pool,kv_cache_utils} and vllm.v1.request
# needs (found by importing and adding what was missing), all under a constraint that
# keeps torch at 2.13.0 so no transitive requirement can swap it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${BENCH_VENV:-.bench-venv}
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
VLLM=vllm==0.33.0

# The import chain's needs, pinned to versions that satisfy vllm 0.33.0's own
# requirements where it states one (transformers, xgrammar, llguidance, fastapi).
VLLM_IMPORT_DEPS=(
    packaging==26.4
    psutil==7.2.2
    pyzmq==27.3.0
    urllib3==2.8.0
    regex==2026.11.19
    numpy==2.4.6
    msgspec==0.23.0
    pydantic==2.14.4
    cbor2==6.3.0
    transformers==5.20.2
    aiohttp==3.14.5
    requests==2.34.2
    openai-harmony==0.0.8
    openai==3.57.0
    pillow==13.0.0
    pybase64==1.5.1
    cachetools==8.0.2
    cloudpickle==3.1.3
    uvloop==0.23.0
    py-cpuinfo==9.0.0
    prometheus-client==0.26.0
    xgrammar==0.2.8
    fastapi==0.136.3
    partial-json-parser==0.2.1.1.post7
    llguidance==1.7.6
)

# kvd's runtime dependencies (pyproject's [project.dependencies]) and matplotlib for
# replay.py --plot; kvd itself goes in editable, without letting pip resolve again.
KVD_DEPS=(msgpack anyio structlog rich matplotlib)

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" >"$constraints"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
"${pip[@]}" "$TORCH"
"${pip[@]}" --no-deps "$VLLM"
"${pip[@]}" -c "$constraints" "${VLLM_IMPORT_DEPS[@]}"
"${pip[@]}" -c "$constraints" "${KVD_DEPS[@]}"
"${pip[@]}" --no-deps -e .

# Fail loudly if anything swapped torch or the manager no longer imports.
"$VENV/bin/python" - <<'EOF'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} crept in"
import vllm
from vllm.v1.core.block_pool import BlockPool  # noqa: F401
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
import kvd, kvd_client  # noqa: F401,E401
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}")
EOF
