"""The store's page of reclamations for the dashboard's list, on both backends: newest first,
by keyset, every reclamation exactly once across the pages, ties on T0 broken by id."""

from __future__ import annotations

from spotdrain.coordinator.store import NewEvent, open_store


def notice(reclaim_id: str, node_id: str, t0: float) -> NewEvent:
    return NewEvent(
        uid=f"u-{reclaim_id}",
        kind="notice_received",
        node_id=node_id,
        reclaim_id=reclaim_id,
        wall_time=t0,
        t_offset_s=0.0,
        details={"t0": t0, "terminate_at": t0 + 120, "reason": "notice"},
    )


async def test_pages_walk_every_reclamation_newest_first_once(store_url):
    """Seven reclamations, two of them with the same T0 on different nodes; pages of three
    walk them newest first, each once, and the walk ends with an empty page."""
    store = await open_store(store_url)
    try:
        t0s = {
            "r-a": 10.0,
            "r-b": 20.0,
            "r-c": 30.0,
            "r-d": 30.0,
            "r-e": 40.0,
            "r-f": 50.0,
            "r-g": 60.0,
        }
        for i, (rid, t0) in enumerate(t0s.items()):
            await store.add_events([notice(rid, f"node-{i}", t0)])
        seen, before = [], None
        for _ in range(5):
            page = await store.reclamations_page(before, limit=3)
            if not page:
                break
            seen.append([rec["reclaim_id"] for rec, _ in page])
            last_rec, last_key = page[-1]
            before = (last_key, last_rec["reclaim_id"])
        assert seen == [["r-g", "r-f", "r-e"], ["r-d", "r-c", "r-b"], ["r-a"]]
        first, key = (await store.reclamations_page(None, limit=1))[0]
        assert key == 60.0 and first["t0"] == 60.0 and first["node_id"] == "node-6"
        assert not [k for k in first if k.startswith("_")]  # the fold's bookkeeping stays in
    finally:
        await store.close()
