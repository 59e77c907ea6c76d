"""The reclamation soak (issue 11): many randomized reclamations on real parts, with faults, and
counts of every broken promise computed from what the parts themselves observed. tests/soak/
soak.py runs it on demand; tests/e2e/test_soak.py runs a short version in CI. README.md says what
is counted and how."""
