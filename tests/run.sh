#!/usr/bin/env bash
# Runs the test suite: set-up (tests/setup.sh), then pytest from the repository root.
#   tests/run.sh                      # all tests, -q
#   tests/run.sh tests/agent/test_cli.py -x   # pytest arguments pass through
# The Docker-backed tests start their own engine when none answers (tests/fakes/dockerenv.py).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tests/setup.sh"
cd "$repo"
if (($# == 0)); then
    set -- -q
fi
exec "$repo/.venv/bin/python" -m pytest "$@"
