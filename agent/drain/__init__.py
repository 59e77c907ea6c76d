"""The drain's shell: the runner that carries out the core's commands, its state on disk, the outbox
and the link to the coordinator."""
