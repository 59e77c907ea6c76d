"""The suite's fakes and emulators: the cloud metadata servers, a fake node's stream, a logind on a
private bus, fake GPUs, S3, PostgreSQL and Patroni servers, the PKI, the Docker test environment,
the process harness, and the one waiting helper (fakes.waiting). Imported as `fakes.<module>` with
tests/ on sys.path (pytest's `pythonpath`; scripts insert it themselves). Their own tests sit here
too."""
