"""Capacity: desired counts, the keeper, acquirers and replacements."""
