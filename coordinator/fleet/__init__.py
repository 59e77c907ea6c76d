"""The fleet as the coordinator runs it: nodes, routes, drains, placement, rentals, risks, the event
log and recovery."""
