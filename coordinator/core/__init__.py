"""The coordinator's rules, pure: the worker machine, timelines, reputation, admission, rental
records, messages."""
