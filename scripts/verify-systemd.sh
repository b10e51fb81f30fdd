#!/usr/bin/env bash
# Check systemd/: the unit with `systemd-analyze verify`, the sysusers.d and
# tmpfiles.d snippets by applying them to a scratch root.
#
# `systemd-analyze verify` exits 0 on unknown keys and typos, so any output at
# all is a failure here. It also insists that ExecStart's binary exists: the
# unit is checked from a copy whose /opt/kvd/bin/kvd is replaced by this
# checkout's .venv/bin/kvd (or /bin/true when there is none).
#
# Usage: scripts/verify-systemd.sh [DIR]   (DIR holds kvd.service, kvd.sysusers
# and kvd.tmpfiles; default: this checkout's systemd/)
#
# systemd-analyze comes with Debian's `systemd` package. When it is missing the
# script installs it under CI (root, CI=true); elsewhere it exits 77 (skipped).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(cd "${1:-$root/systemd}" && pwd)"

if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [[ "${CI:-}" == "true" && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    else
        echo "verify-systemd: systemd-analyze not found (Debian package: systemd); skipped" >&2
        exit 77
    fi
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

fail=0
report() {  # report NAME OUTPUT-FILE STATUS: fail on a non-zero status or any output
    if [[ "$3" != 0 || -s "$2" ]]; then
        echo "verify-systemd: $1 FAILED (status $3):" >&2
        cat "$2" >&2
        fail=1
    else
        echo "verify-systemd: $1 ok"
    fi
}

exe="$root/.venv/bin/kvd"
[[ -x "$exe" ]] || exe=/bin/true
sed "s#/opt/kvd/bin/kvd#$exe#" "$dir/kvd.service" >"$scratch/kvd.service"
status=0
(cd "$scratch" && systemd-analyze verify ./kvd.service) >"$scratch/analyze.out" 2>&1 || status=$?
report "systemd-analyze verify kvd.service" "$scratch/analyze.out" "$status"

# The snippets, applied to an empty root: sysusers creates kvd there, then
# tmpfiles resolves kvd from that root's /etc/passwd.
mkdir -p "$scratch/root/etc"
status=0
systemd-sysusers --root="$scratch/root" "$dir/kvd.sysusers" \
    >"$scratch/sysusers.raw" 2>&1 || status=$?
# "Creating group/user ..." is the expected news; anything else is a problem.
grep -v '^Creating ' "$scratch/sysusers.raw" >"$scratch/sysusers.out" || true
grep -q '^kvd:' "$scratch/root/etc/passwd" 2>/dev/null ||
    echo "user kvd not created" >>"$scratch/sysusers.out"
report "systemd-sysusers kvd.sysusers" "$scratch/sysusers.out" "$status"

status=0
systemd-tmpfiles --root="$scratch/root" --create "$dir/kvd.tmpfiles" \
    >"$scratch/tmpfiles.out" 2>&1 || status=$?
[[ -d "$scratch/root/run/kvd" ]] || echo "/run/kvd not created" >>"$scratch/tmpfiles.out"
report "systemd-tmpfiles kvd.tmpfiles" "$scratch/tmpfiles.out" "$status"

exit "$fail"
