"""Message bounds shared by the agent and the coordinator.

gRPC's own limits are set on purpose on both sides of every channel: a coordinator serving
10,000 nodes must not let one of them make it decode (and store, on the event loop) an
unbounded message. The coordinator refuses anything above these with RESOURCE_EXHAUSTED and a
message saying which bound; the agent splits its outbox batches to fit.
"""

from __future__ import annotations

# Largest message either side accepts on the agent link (gRPC's default is 4 MiB; set here so
# both sides agree and say so).
MAX_AGENT_MESSAGE_BYTES = 4 * 1024 * 1024
# Events per EventBatch, and the batch's serialized size. A batch is stored in one transaction
# and acknowledged once stored: kept small, it never holds the store long enough to delay
# another node's Taint.
MAX_BATCH_EVENTS = 500
MAX_BATCH_BYTES = 1024 * 1024
# One event's details_json. The agent's own events are a few hundred bytes.
MAX_DETAILS_BYTES = 64 * 1024
# Operators' and routers' replies can be large (ListNodes at 10,000 nodes is a few MB).
MAX_ADMIN_MESSAGE_BYTES = 64 * 1024 * 1024
