"""Process runtime: systemd, background tasks, the CLI helpers, metrics, the supervisor."""
