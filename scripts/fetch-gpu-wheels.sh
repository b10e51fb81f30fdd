#!/usr/bin/env bash
# Download the wheels scripts/gpu-check.sh installs on the GPU machine, which
# has no network: kvd's dependencies that its image lacks, for CPython 3.12 on
# manylinux x86_64, one pinned version each, into wheels/ (ignored by git).
#
#   scripts/fetch-gpu-wheels.sh [--dest DIR] [--list]
#
# Needs pip and PyPI; run it here, then carry wheels/ to the GPU machine.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST="$REPO/wheels"

# The versions kvd is tested with (the project's .venv): kvd's requirements that the GPU
# image lacks or may hold too old, and what each needs in turn (rich: markdown-it-py,
# mdurl, pygments; anyio: idna, typing-extensions; mypy: the rest). numpy is not carried
# (the image's is used).
PACKAGES=(
    pyzmq==27.3.0
    structlog==26.1.0
    prometheus-client==0.26.0
    rich==15.0.0
    markdown-it-py==4.3.0
    mdurl==0.1.2
    pygments==2.21.0
    msgpack==1.2.4
    anyio==4.16.0
    idna==3.20
    typing-extensions==4.16.0
    # Build only: setup.py has mypyc compile the engine (gpu-check.sh's install step).
    mypy==2.4.1
    mypy-extensions==1.2.0
    pathspec==1.1.1
    librt==0.17.0
    ast-serialize==0.13.1
)

while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST=$2; shift 2 ;;
        --list) printf '%s\n' "${PACKAGES[@]}"; exit 0 ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "fetch-gpu-wheels: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi

mkdir -p "$DEST"
# One version of each: a second one would stop the install there.
rm -f "$DEST"/*.whl

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done

"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" \
    --dest "$DEST" "${PACKAGES[@]}"

count=$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
    echo "fetch-gpu-wheels: expected ${#PACKAGES[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
ls -l "$DEST"/*.whl
du -sh "$DEST"
