#!/usr/bin/env bash
# Builds the fake OpenAI-compatible model server image, spotdrain-test/fake-model:1, into the
# Docker engine at $DOCKER_HOST (or the default socket). Starts nothing else.
#
#   tests/images/fake_model/build.sh [--force] [--work-dir DIR]
#   DOCKER_HOST=unix:///tmp/spotdrain-demo/docker.sock tests/images/fake_model/build.sh
#
# Prints the image tag on stdout when done. Builds only what is missing or stale (server.py
# changed): a current image takes about a second. The first run on a machine debootstraps a
# Debian bookworm root with python3 (root, the debootstrap package and the Debian mirror
# needed; about half a minute) and caches it in /var/cache/spotdrain-test
# ($SPOTDRAIN_TEST_CACHE); later runs, on any engine, import that tarball in seconds.
# Mirror: $SPOTDRAIN_DEBIAN_MIRROR, else apt's bookworm source, else deb.debian.org.
# Needs the project's venv (.venv, made by tests/setup.sh) for the Docker SDK, or $PYTHON.
# Run the image with images.fake_model.run_model (tests/images/fake_model/__init__.py).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "build.sh: $python not found; run tests/setup.sh (or set PYTHON)" >&2
    exit 2
fi
cd "$repo/tests"
exec "$python" -c 'import sys; from images.fake_model import main; sys.exit(main(sys.argv[1:]))' "$@"
