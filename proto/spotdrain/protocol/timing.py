"""The timeline's defaults and the liveness intervals, defined once for agent and coordinator.

A notice says D (the provider's terminate time); G = D - GRACE_S is when what is still running
is killed; O = D - OVERRUN_S is when a drain that has not ended is an overrun. Each is a
setting somewhere; these are the defaults both sides start from, so an owner's pause from the
agent and one from the coordinator's dashboard name the same G.
"""

# D = T0 + this when a notice names no time (an owner's pause, a Taint without one).
NOTICE_S = 120.0
GRACE_S = 10.0  # G = D - this
OVERRUN_S = 2.0  # O = D - this

HEARTBEAT_S = 5.0  # how often an agent says it is alive
HEARTBEAT_TTL_S = 3 * HEARTBEAT_S  # a ready worker without a heartbeat this long is missing
# A worker not started this long after placement is given up (image pull, model load).
START_TIMEOUT_S = 300.0
# A disconnected node under a reclamation: its rentals end this long after it went away.
NODE_GONE_S = 600.0
# A disconnected node with work and no reclamation open is lost this long after it went away.
NODE_LOST_S = 60.0
