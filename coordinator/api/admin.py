"""The operators' servicer: events from an id, timelines, nodes, workers, the spot flag,
reputation and desired capacity. Operators only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.api.errors import BadRequest, NotFound, grpc_errors, grpc_stream_errors
from spotdrain.coordinator.core import reputation
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.store import NodeRow
from spotdrain.protocol import kinds
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

# A long listing yields to the event loop this often: a Taint is never held behind it.
YIELD_EVERY = 500


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    @grpc_stream_errors
    async def WatchEvents(  # noqa: N802
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StoredEvent]:
        self.coord.operator(context)
        last = max(request.from_id, 0)
        while True:
            rows = await self.coord.store.events_after(last)
            for row in rows:
                last = row.id
                yield convert.event_pb(row)
            if rows:
                continue
            if not request.follow:
                return
            await self.coord.events.wait(timeout=1.0)

    @grpc_errors
    async def GetTimeline(  # noqa: N802
        self, request: pb.GetTimelineRequest, context: grpc.aio.ServicerContext
    ) -> pb.Timeline:
        self.coord.operator(context)
        record = await self.coord.store.reclamation(request.reclaim_id)
        if record is None:
            what = f"reclamation {request.reclaim_id!r}" if request.reclaim_id else "reclamation"
            raise NotFound(f"no {what} recorded")
        events = await self.coord.store.events_of(record["reclaim_id"])
        return pb.Timeline(
            reclamation=convert.reclamation_pb(record),
            events=[convert.event_pb(r) for r in events],
        )

    @grpc_errors
    async def ListNodes(  # noqa: N802
        self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesReply:
        self.coord.operator(context)
        rows = await self.coord.store.nodes()
        active: dict[str, int] = {}
        for rental in await self.coord.fleet.rentals.list(active_only=True):
            active[rental.node_id] = active.get(rental.node_id, 0) + 1
        nodes = []
        for i, row in enumerate(rows):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            nodes.append(self._node_pb(row, active.get(row.node_id, 0)))
        return pb.ListNodesReply(nodes=nodes)

    def _node_pb(self, row: NodeRow, active_rentals: int) -> pb.Node:
        fleet = self.coord.fleet
        return convert.node_pb(
            row,
            fleet.nodes.node_taints(row.node_id),
            fleet.nodes.connected.get(row.node_id),
            fleet.registry.count(row.node_id),
            active_rentals,
            fleet.nodes.avoided_now().get(row.node_group, 0.0),
        )

    @grpc_errors
    async def SetNodeSpot(  # noqa: N802
        self, request: pb.SetNodeSpotRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        self.coord.operator(context)
        node_id = convert.check_id(request.node_id, "node_id")
        row = await self.coord.fleet.drains.set_spot(node_id, request.spot)
        active = await self.coord.fleet.rentals.list(node_id, active_only=True)
        return self._node_pb(row, len(active))

    @grpc_errors
    async def GetReputation(  # noqa: N802
        self, request: pb.GetReputationRequest, context: grpc.aio.ServicerContext
    ) -> pb.Reputation:
        self.coord.operator(context)
        store = self.coord.store
        outcomes = [
            reputation.RentalOutcome(
                d["rental_id"],
                d["node_id"],
                d["provider"],
                d["started_on_spot"],
                d["ended_by"] or None,
            )
            for d in await store.rental_docs()
        ]
        which = request.WhichOneof("subject")
        if which == "node_id":
            if self.coord.fleet.nodes.rows.get(request.node_id) is None:
                raise NotFound(f"no node {request.node_id!r}")
            score = reputation.node_score(outcomes, request.node_id)
        elif which == "provider":
            rows = self.coord.fleet.nodes.rows.values()
            known = {n.owner for n in rows} | {o.provider for o in outcomes}
            if request.provider not in known:
                raise NotFound(f"no provider {request.provider!r}")
            score = reputation.provider_score(outcomes, request.provider)
        else:
            raise BadRequest("give a node_id or a provider")
        return pb.Reputation(
            node_id=request.node_id,
            provider=request.provider,
            score=score.value,
            successes=score.successes,
            failures=score.failures,
            counted=score.counted,
            excluded_spot=score.excluded_spot,
            neutral_reclaims=score.neutral_reclaims,
        )

    @grpc_errors
    async def SetModelReplicas(  # noqa: N802
        self, request: pb.SetModelReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.Model:
        self.coord.operator(context)
        store = self.coord.store
        known = await store.model(request.model)
        image = request.image or (known.image if known else "")
        if not request.model or not image:
            raise BadRequest("a model name is needed, and an image the first time a model is set")
        convert.check_id(request.model, "model")
        slots = request.slots or (known.slots if known else 4)
        await store.set_model(request.model, request.replicas, image, slots)
        await self.coord.record(
            "model_replicas_set", "", {"model": request.model, "replicas": request.replicas}
        )
        await self.coord.fleet.capacity.keep(path="operator")
        return await self._model_pb(request.model)

    @grpc_errors
    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsReply:
        self.coord.operator(context)
        models = await self.coord.store.models()
        return pb.ListModelsReply(models=[await self._model_pb(m.model) for m in models])

    async def _model_pb(self, model: str) -> pb.Model:
        row = await self.coord.store.model(model)
        if row is None:
            raise NotFound(f"no model {model!r}")
        states = [w.state for w in self.coord.fleet.live_workers() if w.model == model]
        return pb.Model(
            model=row.model,
            replicas=row.replicas,
            image=row.image,
            slots=row.slots,
            ready=states.count(wm.READY),
            starting=states.count(wm.STARTING),
            draining=states.count(wm.DRAINING),
        )

    @grpc_errors
    async def ListWorkloadContracts(  # noqa: N802
        self, request: pb.ListWorkloadContractsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkloadContractsReply:
        self.coord.operator(context)
        contracts = self.coord.fleet.contracts
        rows = await self.coord.store.contracts()
        contracts.load(rows)
        reply = pb.ListWorkloadContractsReply(
            budget=contracts.policy.budget,
            min_reclamations=contracts.policy.min_reclamations,
            no_spot_for_flagged=contracts.policy.no_spot_for_flagged,
        )
        for r in rows:
            c = reply.contracts.add(
                image=r.image,
                kind=r.kind,
                exited=r.exited,
                killed=r.killed,
                overrun=r.overrun,
                reclamations=r.reclamations,
                share=r.failed_share,
                flagged=r.flagged_at is not None,
            )
            if r.flagged_at is not None:
                c.flagged_at = r.flagged_at
        return reply

    @grpc_errors
    async def StartWorker(  # noqa: N802
        self, request: pb.StartWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        self.coord.operator(context)
        if not request.node_id or not request.model or not request.image:
            raise BadRequest("node, model and image needed")
        kind = request.kind or "inference"
        if kind not in kinds.WORKERS:
            raise BadRequest(f"kind must be one of {kinds.WORKERS}")
        worker = await self.coord.fleet.gate.place_worker(
            request.node_id,
            request.model,
            request.image,
            request.slots or 1,
            request.port,
            path="operator",
            kind=kind,
        )
        return convert.worker_pb(worker)

    @grpc_errors
    async def ListWorkers(  # noqa: N802
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersReply:
        self.coord.operator(context)
        workers = await self.coord.fleet.all_workers(request.node_id)
        return pb.ListWorkersReply(workers=[convert.worker_pb(w) for w in workers])
