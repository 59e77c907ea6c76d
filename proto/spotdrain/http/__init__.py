"""HTTP helpers: server-sent events."""
