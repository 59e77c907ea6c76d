#!/usr/bin/env bash
# Builds the Debian packages spotdrain-agent and spotdrain-coordinator with dpkg-buildpackage.
#
#   packaging/build-deb.sh [--force] [OUT_DIR]          (OUT_DIR default: dist/deb)
#
# Writes OUT_DIR/spotdrain-agent_<version>_<arch>.deb and spotdrain-coordinator_..., and prints
# their paths. Builds on any Debian-family host with python3 >= 3.11: each package carries
# wheels for CPython 3.11 to 3.14, and postinst makes the venv on the target (packaging/README.md).
# Needs root or not (Rules-Requires-Root: no); needs the build dependencies of
# packaging/debian/control (dpkg-checkbuilddeps names what is missing) and PyPI, or a pip cache
# that holds every wheel: $PIP_CACHE_DIR (default /var/cache/spotdrain-build/pip when writable,
# else ~/.cache/pip).
#
# The sources (pyproject.toml, README.md, proto/, agent/, coordinator/, packaging/) are copied
# to a scratch tree with packaging/debian as debian/. When OUT_DIR already holds both packages
# built from the same sources (OUT_DIR/.source-hash), nothing is rebuilt; --force rebuilds.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
force=0
if [[ "${1:-}" == "--force" ]]; then
    force=1
    shift
fi
out="$(realpath -m "${1:-$repo/dist/deb}")"

# The packages carry wheels for every CPython they support (debian/rules), whatever this host's
# python3 is; it only runs pip.
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "build-deb.sh: needs python3 >= 3.11 with venv (python3-venv)" >&2
    exit 2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/spotdrain-deb.XXXXXX")"
trap 'rm -rf "$work"' EXIT
src="$work/spotdrain"
mkdir -p "$src"
tar -C "$repo" -c \
    --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
    --exclude=build --exclude=dist --exclude=.venv \
    pyproject.toml README.md proto agent coordinator packaging | tar -C "$src" -x
cp -a "$src/packaging/debian" "$src/debian"

hash="$(cd "$src" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
if ((!force)) && [[ "$(cat "$out/.source-hash" 2>/dev/null)" == "$hash" ]] &&
    compgen -G "$out/spotdrain-agent_*.deb" >/dev/null &&
    compgen -G "$out/spotdrain-coordinator_*.deb" >/dev/null; then
    echo "build-deb.sh: $out is up to date (sources $hash)" >&2
    ls "$out"/spotdrain-agent_*.deb "$out"/spotdrain-coordinator_*.deb
    exit 0
fi

# The package version is the project's: debian/changelog must name pyproject.toml's version.
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$src/pyproject.toml" | head -n1)"
changelog="$(cd "$src" && dpkg-parsechangelog -S Version)"
if [[ "$changelog" != "$version" && "$changelog" != "$version"-* ]]; then
    echo "build-deb.sh: debian/changelog is at $changelog but pyproject.toml at $version;" \
        "add a changelog entry (dch -v $version)" >&2
    exit 2
fi

if [[ -z "${PIP_CACHE_DIR:-}" ]]; then
    if mkdir -p /var/cache/spotdrain-build/pip 2>/dev/null && [[ -w /var/cache/spotdrain-build/pip ]]; then
        export PIP_CACHE_DIR=/var/cache/spotdrain-build/pip
    else
        export PIP_CACHE_DIR="$HOME/.cache/pip"
    fi
fi

started=$SECONDS
(cd "$src" && dpkg-buildpackage --build=binary --no-sign -j"$(nproc)") >"$work/build.log" 2>&1 || {
    tail -n 60 "$work/build.log" >&2
    echo "build-deb.sh: dpkg-buildpackage failed (last lines above)" >&2
    exit 1
}

mkdir -p "$out"
rm -f "$out"/spotdrain-agent_*.deb "$out"/spotdrain-coordinator_*.deb "$out"/spotdrain_*.changes \
    "$out"/spotdrain_*.buildinfo "$out/.source-hash"
mv "$work"/*.deb "$work"/*.changes "$work"/*.buildinfo "$out/"
cp "$work/build.log" "$out/build.log"
echo "$hash" >"$out/.source-hash"
echo "build-deb.sh: built in $((SECONDS - started)) s (sources $hash)" >&2
ls "$out"/spotdrain-agent_*.deb "$out"/spotdrain-coordinator_*.deb
