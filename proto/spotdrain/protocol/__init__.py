"""What agent and coordinator agree on: event kinds, limits."""
