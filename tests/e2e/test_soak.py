"""The reclamation soak's short version (issue 11; tests/soak/, where soak.py runs 1,000 on
demand): 30 randomized reclamations on real parts under random faults, every broken promise
counted from what the workloads, the engine, the agents' outboxes and the coordinator observed.
"""

from __future__ import annotations

import os
import random

import pytest

from soak.counts import FAILURES, count, report
from soak.scenario import Soak, SoakConfig

pytestmark = pytest.mark.docker

RECLAMATIONS = 30


def test_thirty_reclamations_under_random_faults_break_no_promise(
    tmp_path, docker_engine, docker_images, nvml_lib, containers
):
    """Three nodes on one coordinator answer 30 reclamations between them: notices, owner
    pauses (some resumed mid-drain) and cancels, each with one to three jobs that exit at once,
    checkpoint within the budget or ignore SIGTERM, and deadlines a few seconds away. All the
    while the coordinator is SIGKILLed and started again or SIGSTOPped for up to 3 s, and agents
    are SIGKILLed and started again. No job that honoured SIGTERM overruns, none hears SIGTERM
    twice, no event is lost or stored twice, no `drained` comes without an empty look, no
    deadline moves, nothing crashes, and all 30 reclamations are completed and recorded.
    A failure names its seed: SPOTDRAIN_SOAK_SEED=<seed> replays the same reclamations."""
    seed = int(os.environ.get("SPOTDRAIN_SOAK_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"soak seed {seed}")
    config = SoakConfig(reclamations=RECLAMATIONS, nodes=3, seed=seed)
    soak = Soak(config, tmp_path, docker_engine.host, nvml_lib, prefix=containers)
    soak.run()
    counts = count(soak)
    # The agents' and coordinator's logs and stores stay in the work dir for a failure.
    summary = f"{report(counts, seed)}\nwork dir {tmp_path}"
    print(summary)
    assert counts.counts == dict.fromkeys(FAILURES, 0), summary
    assert counts.completed == RECLAMATIONS, summary
    assert len(soak.rounds) == RECLAMATIONS
    # The faults did happen, and in the middle of reclamations.
    assert soak.faults and counts.info["reclamations_hit_by_a_fault"] > 0, summary
