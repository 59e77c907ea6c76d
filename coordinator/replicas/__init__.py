"""Coordinator replicas: the leader lease and leadership."""
