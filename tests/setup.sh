#!/usr/bin/env bash
# Prepares this machine to run the tests. Idempotent; needs root only when it has to install.
#   - Debian packages: Docker (the engine the tests start themselves), busybox-static (the test
#     images' userland), python3-venv, a C compiler (the fake NVML library).
#   - .venv in the repository root, with the project installed editable with its test extras,
#     reinstalled whenever pyproject.toml changes.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.spotdrain-install-stamp"

packages=(docker.io busybox-static debootstrap python3-venv gcc libc6-dev ca-certificates
          libsystemd-dev pkg-config python3-dev)
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
