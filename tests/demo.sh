#!/usr/bin/env bash
# The main job: a coordinator, two agents on fake GPUs, real containers, one provider notice,
# and the timeline printed. Set-up first (tests/setup.sh: Debian packages, .venv), so this one
# command works as root on a fresh Debian machine.
#   tests/demo.sh                 # 30 s notice
#   tests/demo.sh --deadline 60   # options go to tests/demo.py
#   tests/demo.sh --ha            # two replicas over PostgreSQL, the leader SIGKILLed in act 1
#   tests/demo.sh --slurm         # and an act 3 on a private Slurm cluster (a requeued job)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tests/setup.sh"
cd "$repo"
exec "$repo/.venv/bin/python" "$repo/tests/demo.py" "$@"
