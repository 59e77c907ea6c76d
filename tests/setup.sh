#!/usr/bin/env bash
# Prepares this machine to run the tests. Idempotent; needs root only when it has to install.
#   - Debian packages: Docker (the engine the tests start themselves), busybox-static (the test
#     images' userland), python3-venv, a C compiler (the fake NVML library), PostgreSQL (the
#     server the store tests start themselves, tests/fakes/pgserver.py), dbus-daemon (the private bus
#     the shutdown source's tests run a fake logind on), chromium (the dashboard's browser test
#     drives it through Playwright's executable_path; Playwright never downloads a browser here),
#     patroni and etcd-server (the PostgreSQL cluster the failover test starts itself,
#     tests/fakes/patroni.py; neither is started as a service), slurmctld, slurmd, slurm-client
#     and munge (the Slurm cluster tests/fakes/slurm.py starts itself, with its own munged).
#   - .venv in the repository root, with the project installed editable with its test extras,
#     reinstalled whenever pyproject.toml changes.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.spotdrain-install-stamp"

# libsystemd-dev, pkg-config and python3-dev: only because packaging/debian/control still lists
# them as Build-Depends (dpkg-buildpackage checks them); nothing compiles against them now that
# the journal is spoken to without systemd-python. Drop them here when control drops them.
packages=(docker.io busybox-static debootstrap python3-venv gcc libc6-dev ca-certificates
          libsystemd-dev pkg-config python3-dev
          build-essential debhelper lintian systemd postgresql dbus-daemon chromium
          patroni etcd-server slurmctld slurmd slurm-client munge)
missing=()
for package in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$package")
    fi
done
if ((${#missing[@]})); then
    if ((EUID != 0)); then
        echo "tests/setup.sh: missing Debian packages: ${missing[*]}; run it as root" >&2
        exit 1
    fi
    echo "tests/setup.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# promtool (tests check live scrapes with `promtool check metrics`): taken from Debian's
# prometheus package without installing the server it comes with.
if ! command -v promtool >/dev/null 2>&1; then
    if ((EUID != 0)); then
        echo "tests/setup.sh: promtool missing; run it as root" >&2
        exit 1
    fi
    echo "tests/setup.sh: installing promtool from Debian's prometheus package" >&2
    scratch="$(mktemp -d)"
    (cd "$scratch" && apt-get download -qq prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download -qq prometheus; })
    dpkg-deb -x "$scratch"/prometheus_*.deb "$scratch/root"
    install -m 0755 "$scratch/root/usr/bin/promtool" /usr/local/bin/promtool
    rm -rf "$scratch"
fi

if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "tests/setup.sh: creating $venv" >&2
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi

want="$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "tests/setup.sh: installing the project into $venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo[test]"
    echo "$want" >"$stamp"
fi
