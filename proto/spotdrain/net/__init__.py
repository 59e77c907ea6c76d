"""Network helpers: the leader-following client, TLS."""
