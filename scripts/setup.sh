#!/usr/bin/env bash
# Set up everything dedup needs on a fresh Debian/Ubuntu machine with Python 3.11+:
# redis-server (always), PostgreSQL server binaries (with --tests), and the
# virtualenv .venv with the package and its extras. Safe to run again: each step
# is skipped when already done.
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
# The claim scripts use SET ... NX GET: Redis 7.0 or newer (Ubuntu 22.04 ships 6.0).
redis_version=$(redis-server --version | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')
if [[ -n $redis_version ]] && (( ${redis_version%%.*} < 7 )); then
    say "redis-server $redis_version is older than 7.0, which dedup needs. Install Redis 7 from"
    say "redis.io's packages (https://redis.io/docs/latest/operate/oss_and_stack/install/install-redis/install-redis-on-linux/):"
    say "  curl -fsSL https://packages.redis.io/gpg | sudo gpg --dearmor -o /usr/share/keyrings/redis-archive-keyring.gpg"
    say "  echo \"deb [signed-by=/usr/share/keyrings/redis-archive-keyring.gpg] https://packages.redis.io/deb \$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/redis.list"
    say "  sudo apt-get update && sudo apt-get install -y redis"
    say "then run this again (or put a Redis 7 redis-server first on PATH)."
    exit 1
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
extras=$([[ $want_tests -eq 1 ]] && echo "test" || echo "")
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
say "ready"
