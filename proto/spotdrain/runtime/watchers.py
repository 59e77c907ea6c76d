"""Queues that watch keys (a model's routes, a rental, a reclamation's live page): a set of
queues a key, the key forgotten with its last queue, so the registry never outgrows the watches
that are open."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Watchers(Generic[K, V]):
    def __init__(self) -> None:
        self._queues: dict[K, set[asyncio.Queue[V]]] = {}

    def add(self, key: K, queue: asyncio.Queue[V]) -> asyncio.Queue[V]:
        self._queues.setdefault(key, set()).add(queue)
        return queue

    def remove(self, key: K, queue: asyncio.Queue[V]) -> None:
        queues = self._queues.get(key, set())
        queues.discard(queue)
        if not queues:
            self._queues.pop(key, None)

    def of(self, key: K) -> list[asyncio.Queue[V]]:
        """The key's queues, a copy: one may be removed while they are served."""
        return list(self._queues.get(key, ()))

    def __contains__(self, key: object) -> bool:
        return key in self._queues

    def __len__(self) -> int:
        """The queues open, over every key."""
        return sum(len(queues) for queues in self._queues.values())
