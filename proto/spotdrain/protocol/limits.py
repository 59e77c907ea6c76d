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
# Any string of a request (names, reasons, addresses, images) unless it has a bound of its own
# (an id: 256 characters; an event's details: MAX_DETAILS_BYTES), and the elements of any
# repeated field (an EventBatch has its own, smaller bound). Refused with INVALID_ARGUMENT and
# RESOURCE_EXHAUSTED before any servicer sees the request.
MAX_STRING_CHARS = 4096
MAX_REPEATED = 10_000
# A status message is at most this long: it often quotes what the caller sent, and a client
# drops a reply whose trailers pass its metadata limit (16 KiB).
MAX_STATUS_CHARS = 512
# A registration's work managers (Register.managers): how many, and the length of each name,
# node name and cluster in it (Slurm's NodeName is at most 64 characters too).
MAX_MANAGERS = 8
MAX_MANAGER_CHARS = 64
# Each value of a node's cloud identity (Register.cloud): ids, regions, zones and instance types
# are a few dozen characters at every provider.
MAX_CLOUD_CHARS = 64
