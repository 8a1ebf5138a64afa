#!/usr/bin/env bash
# Install what a group of system tests needs, with apt, only when something is missing:
#
#   bash tests/apt_install.sh NAME REQUIRE_VAR WHAT "COMMANDS" PACKAGES...
#
# NAME names the caller in messages; COMMANDS (space separated) are what must be on PATH or in
# /usr/sbin (Debian's daemons; a non-login shell may not have it on PATH), or an absolute path that
# must exist (a data package's folder: /usr/share/datasets/fashion-mnist); WHAT is what skips
# without them. Idempotent and fast (no apt call) when every command is there. Without root or
# apt it prints a notice and succeeds, and the tests skip; if apt fails with REQUIRE_VAR=1 (CI)
# it exits 1, so CI does not quietly lose those tests.
set -euo pipefail

name=$1 require_var=$2 what=$3 commands=$4
shift 4
packages=("$@")

missing=()
for cmd in $commands; do
    if [[ $cmd == /* ]]; then
        [[ -e $cmd ]] || missing+=("$cmd")
        continue
    fi
    command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || missing+=("$cmd")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -ne 0 ]]; then
    echo "$name: missing ${missing[*]} and not root; $what will skip." >&2
    echo "  To run it (as root): apt-get install -y ${packages[*]}" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$name: missing ${missing[*]} and no apt-get here; install ${packages[*]} yourself." >&2
    exit 0
fi

echo "$name: installing ${packages[*]} (missing: ${missing[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt run to release the dpkg lock (seen: a second `make test` beside this one)
# instead of failing at once.
if ! { apt-get -o DPkg::Lock::Timeout=600 update -q &&
       apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${packages[@]}"; }; then
    echo "$name: apt-get could not install ${packages[*]}; $what will skip." >&2
    [[ ${!require_var:-0} == 0 ]] || exit 1
fi
