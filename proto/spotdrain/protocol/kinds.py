"""The kinds of workload spotdrain runs, defined once for agent, coordinator and spotctl.

- inference: a worker behind a slot gate; drained by its gate (no new requests, the last
  slot's release stops it), so the SIGTERM round leaves it alone.
- batch, render: jobs, plain containers that run until they exit; SIGTERMed at once on a
  notice and expected to checkpoint before the grace deadline.
- rental: a renter's container; told its reclaim time, stopped by the renter or at G, never
  SIGTERMed early by the round.
"""

INFERENCE = "inference"
BATCH = "batch"
RENDER = "render"
RENTAL = "rental"

ALL = (INFERENCE, BATCH, RENTAL, RENDER)
# What StartWorker (and `spotctl worker start --kind`) may ask for; rentals come by StartRental.
WORKERS = (INFERENCE, BATCH, RENDER)
JOBS = frozenset({BATCH, RENDER})
# Kinds the SIGTERM round leaves alone: each has a drain of its own (see the list above).
NOT_SIGTERMED = frozenset({INFERENCE, RENTAL})
