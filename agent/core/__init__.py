"""The node's rules, pure: the reclamation machine, notices and advisories."""
