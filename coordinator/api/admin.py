"""The operators' servicer: events from an id, timelines, nodes, workers, the spot flag,
reputation and desired capacity. Operators only. Each method checks the caller, converts, and
calls coordinator/api/operations.py (what the dashboard calls too)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.api.errors import BadRequest, grpc_errors, grpc_stream_errors
from spotdrain.protocol import kinds
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


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
        return convert.timeline_pb(*await self.coord.ops.timeline(request.reclaim_id))

    @grpc_errors
    async def ListNodes(  # noqa: N802
        self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesReply:
        self.coord.operator(context)
        return pb.ListNodesReply(nodes=[convert.node_pb(n) for n in await self.coord.ops.nodes()])

    @grpc_errors
    async def SetNodeSpot(  # noqa: N802
        self, request: pb.SetNodeSpotRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        self.coord.operator(context)
        node_id = convert.check_id(request.node_id, "node_id")
        return convert.node_pb(await self.coord.ops.set_spot(node_id, request.spot))

    @grpc_errors
    async def GetReputation(  # noqa: N802
        self, request: pb.GetReputationRequest, context: grpc.aio.ServicerContext
    ) -> pb.Reputation:
        self.coord.operator(context)
        which = request.WhichOneof("subject")
        if which == "node_id":
            score = await self.coord.ops.node_reputation(request.node_id)
        elif which == "provider":
            score = await self.coord.ops.provider_reputation(request.provider)
        else:
            raise BadRequest("give a node_id or a provider")
        return convert.reputation_pb(request.node_id, request.provider, score)

    @grpc_errors
    async def SetModelReplicas(  # noqa: N802
        self, request: pb.SetModelReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.Model:
        self.coord.operator(context)
        model = convert.check_id(request.model, "model", required=False)
        status = await self.coord.ops.set_replicas(
            model, request.replicas, request.image, request.slots
        )
        return convert.model_pb(status)

    @grpc_errors
    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsReply:
        self.coord.operator(context)
        models = await self.coord.ops.models()
        return pb.ListModelsReply(models=[convert.model_pb(m) for m in models])

    @grpc_errors
    async def ListWorkloadContracts(  # noqa: N802
        self, request: pb.ListWorkloadContractsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkloadContractsReply:
        self.coord.operator(context)
        return convert.contracts_pb(await self.coord.ops.contracts())

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
