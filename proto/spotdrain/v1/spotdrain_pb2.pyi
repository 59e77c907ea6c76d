from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "gpus", "spot", "node_group", "agent_version", "workers", "provider", "rentals", "inventory_incomplete", "managers", "cloud")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    NODE_GROUP_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    RENTALS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    MANAGERS_FIELD_NUMBER: _ClassVar[int]
    CLOUD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    spot: bool
    node_group: str
    agent_version: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerReport]
    provider: str
    rentals: _containers.RepeatedCompositeFieldContainer[RentalReport]
    inventory_incomplete: bool
    managers: _containers.RepeatedCompositeFieldContainer[WorkManager]
    cloud: CloudIdentity
    def __init__(self, node_id: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., spot: _Optional[bool] = ..., node_group: _Optional[str] = ..., agent_version: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerReport, _Mapping]]] = ..., provider: _Optional[str] = ..., rentals: _Optional[_Iterable[_Union[RentalReport, _Mapping]]] = ..., inventory_incomplete: _Optional[bool] = ..., managers: _Optional[_Iterable[_Union[WorkManager, _Mapping]]] = ..., cloud: _Optional[_Union[CloudIdentity, _Mapping]] = ...) -> None: ...

class WorkManager(_message.Message):
    __slots__ = ("name", "node_name", "cluster")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    node_name: str
    cluster: str
    def __init__(self, name: _Optional[str] = ..., node_name: _Optional[str] = ..., cluster: _Optional[str] = ...) -> None: ...

class CloudIdentity(_message.Message):
    __slots__ = ("provider", "instance_id", "region", "zone", "instance_type", "spot")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    provider: str
    instance_id: str
    region: str
    zone: str
    instance_type: str
    spot: bool
    def __init__(self, provider: _Optional[str] = ..., instance_id: _Optional[str] = ..., region: _Optional[str] = ..., zone: _Optional[str] = ..., instance_type: _Optional[str] = ..., spot: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("node_id", "workers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSlots]
    def __init__(self, node_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerSlots, _Mapping]]] = ...) -> None: ...

class WorkerSlots(_message.Message):
    __slots__ = ("worker_id", "slots_in_use", "capacity", "claimed_state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    slots_in_use: int
    capacity: int
    claimed_state: str
    def __init__(self, worker_id: _Optional[str] = ..., slots_in_use: _Optional[int] = ..., capacity: _Optional[int] = ..., claimed_state: _Optional[str] = ...) -> None: ...

class SlotReport(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSlots]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerSlots, _Mapping]]] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("worker_id", "state", "gate_address", "capacity", "exit_code", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GATE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    gate_address: str
    capacity: int
    exit_code: int
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., gate_address: _Optional[str] = ..., capacity: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("uid", "kind", "node_id", "reclaim_id", "wall_time", "t_offset_s", "details_json")
    UID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    T_OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    uid: str
    kind: str
    node_id: str
    reclaim_id: str
    wall_time: float
    t_offset_s: float
    details_json: str
    def __init__(self, uid: _Optional[str] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ..., reclaim_id: _Optional[str] = ..., wall_time: _Optional[float] = ..., t_offset_s: _Optional[float] = ..., details_json: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "events", "worker", "slots", "rental")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RENTAL_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    events: EventBatch
    worker: WorkerReport
    slots: SlotReport
    rental: RentalReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., worker: _Optional[_Union[WorkerReport, _Mapping]] = ..., slots: _Optional[_Union[SlotReport, _Mapping]] = ..., rental: _Optional[_Union[RentalReport, _Mapping]] = ...) -> None: ...

class RentalReport(_message.Message):
    __slots__ = ("rental_id", "state", "container", "exit_code", "reason", "reclaim_id", "reclaim_reason", "reclaim_at")
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_REASON_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_AT_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    state: str
    container: str
    exit_code: int
    reason: str
    reclaim_id: str
    reclaim_reason: str
    reclaim_at: float
    def __init__(self, rental_id: _Optional[str] = ..., state: _Optional[str] = ..., container: _Optional[str] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., reclaim_id: _Optional[str] = ..., reclaim_reason: _Optional[str] = ..., reclaim_at: _Optional[float] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("node_id", "taints")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TAINTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    taints: _containers.RepeatedCompositeFieldContainer[Taint]
    def __init__(self, node_id: _Optional[str] = ..., taints: _Optional[_Iterable[_Union[Taint, _Mapping]]] = ...) -> None: ...

class EventAck(_message.Message):
    __slots__ = ("uids",)
    UIDS_FIELD_NUMBER: _ClassVar[int]
    uids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, uids: _Optional[_Iterable[str]] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("registered", "ack", "start_worker", "drain_worker", "start_rental", "stop_rental")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    START_WORKER_FIELD_NUMBER: _ClassVar[int]
    DRAIN_WORKER_FIELD_NUMBER: _ClassVar[int]
    START_RENTAL_FIELD_NUMBER: _ClassVar[int]
    STOP_RENTAL_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    ack: EventAck
    start_worker: StartWorker
    drain_worker: DrainWorker
    start_rental: StartRental
    stop_rental: StopRental
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., ack: _Optional[_Union[EventAck, _Mapping]] = ..., start_worker: _Optional[_Union[StartWorker, _Mapping]] = ..., drain_worker: _Optional[_Union[DrainWorker, _Mapping]] = ..., start_rental: _Optional[_Union[StartRental, _Mapping]] = ..., stop_rental: _Optional[_Union[StopRental, _Mapping]] = ...) -> None: ...

class StartRental(_message.Message):
    __slots__ = ("rental_id", "image", "gpus", "renter")
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RENTER_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    image: str
    gpus: int
    renter: str
    def __init__(self, rental_id: _Optional[str] = ..., image: _Optional[str] = ..., gpus: _Optional[int] = ..., renter: _Optional[str] = ...) -> None: ...

class StopRental(_message.Message):
    __slots__ = ("rental_id", "reason")
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    reason: str
    def __init__(self, rental_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StartWorker(_message.Message):
    __slots__ = ("worker_id", "model", "image", "port", "capacity", "kind")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    image: str
    port: int
    capacity: int
    kind: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., image: _Optional[str] = ..., port: _Optional[int] = ..., capacity: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class DrainWorker(_message.Message):
    __slots__ = ("worker_id", "reclaim_id", "reason", "grace_deadline", "terminate_at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TERMINATE_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reclaim_id: str
    reason: str
    grace_deadline: float
    terminate_at: float
    def __init__(self, worker_id: _Optional[str] = ..., reclaim_id: _Optional[str] = ..., reason: _Optional[str] = ..., grace_deadline: _Optional[float] = ..., terminate_at: _Optional[float] = ...) -> None: ...

class Taint(_message.Message):
    __slots__ = ("key", "effect", "reclaim_id", "reason", "since")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    effect: str
    reclaim_id: str
    reason: str
    since: float
    def __init__(self, key: _Optional[str] = ..., effect: _Optional[str] = ..., reclaim_id: _Optional[str] = ..., reason: _Optional[str] = ..., since: _Optional[float] = ...) -> None: ...

class TaintRequest(_message.Message):
    __slots__ = ("node_id", "reclaim_id", "reason", "remove", "terminate_at", "grace_deadline")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    TERMINATE_AT_FIELD_NUMBER: _ClassVar[int]
    GRACE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reclaim_id: str
    reason: str
    remove: bool
    terminate_at: float
    grace_deadline: float
    def __init__(self, node_id: _Optional[str] = ..., reclaim_id: _Optional[str] = ..., reason: _Optional[str] = ..., remove: _Optional[bool] = ..., terminate_at: _Optional[float] = ..., grace_deadline: _Optional[float] = ...) -> None: ...

class SetWorkloadRequest(_message.Message):
    __slots__ = ("node_id", "enabled", "reclaim_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    enabled: bool
    reclaim_id: str
    def __init__(self, node_id: _Optional[str] = ..., enabled: _Optional[bool] = ..., reclaim_id: _Optional[str] = ...) -> None: ...

class SetWorkloadReply(_message.Message):
    __slots__ = ("workload_enabled",)
    WORKLOAD_ENABLED_FIELD_NUMBER: _ClassVar[int]
    workload_enabled: bool
    def __init__(self, workload_enabled: _Optional[bool] = ...) -> None: ...

class TaintReply(_message.Message):
    __slots__ = ("taints",)
    TAINTS_FIELD_NUMBER: _ClassVar[int]
    taints: _containers.RepeatedCompositeFieldContainer[Taint]
    def __init__(self, taints: _Optional[_Iterable[_Union[Taint, _Mapping]]] = ...) -> None: ...

class SetNodeSpotRequest(_message.Message):
    __slots__ = ("node_id", "spot")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    spot: bool
    def __init__(self, node_id: _Optional[str] = ..., spot: _Optional[bool] = ...) -> None: ...

class GetReputationRequest(_message.Message):
    __slots__ = ("node_id", "provider")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    provider: str
    def __init__(self, node_id: _Optional[str] = ..., provider: _Optional[str] = ...) -> None: ...

class Reputation(_message.Message):
    __slots__ = ("node_id", "provider", "score", "successes", "failures", "counted", "excluded_spot", "neutral_reclaims")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_SPOT_FIELD_NUMBER: _ClassVar[int]
    NEUTRAL_RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    provider: str
    score: float
    successes: int
    failures: int
    counted: int
    excluded_spot: int
    neutral_reclaims: int
    def __init__(self, node_id: _Optional[str] = ..., provider: _Optional[str] = ..., score: _Optional[float] = ..., successes: _Optional[int] = ..., failures: _Optional[int] = ..., counted: _Optional[int] = ..., excluded_spot: _Optional[int] = ..., neutral_reclaims: _Optional[int] = ...) -> None: ...

class SetModelReplicasRequest(_message.Message):
    __slots__ = ("model", "replicas", "image", "slots")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    replicas: int
    image: str
    slots: int
    def __init__(self, model: _Optional[str] = ..., replicas: _Optional[int] = ..., image: _Optional[str] = ..., slots: _Optional[int] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("model", "replicas", "image", "slots", "ready", "starting", "draining")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model: str
    replicas: int
    image: str
    slots: int
    ready: int
    starting: int
    draining: int
    def __init__(self, model: _Optional[str] = ..., replicas: _Optional[int] = ..., image: _Optional[str] = ..., slots: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class ListWorkloadContractsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkloadContract(_message.Message):
    __slots__ = ("image", "kind", "exited", "killed", "overrun", "reclamations", "share", "flagged", "flagged_at")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    KILLED_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_FIELD_NUMBER: _ClassVar[int]
    RECLAMATIONS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_AT_FIELD_NUMBER: _ClassVar[int]
    image: str
    kind: str
    exited: int
    killed: int
    overrun: int
    reclamations: int
    share: float
    flagged: bool
    flagged_at: float
    def __init__(self, image: _Optional[str] = ..., kind: _Optional[str] = ..., exited: _Optional[int] = ..., killed: _Optional[int] = ..., overrun: _Optional[int] = ..., reclamations: _Optional[int] = ..., share: _Optional[float] = ..., flagged: _Optional[bool] = ..., flagged_at: _Optional[float] = ...) -> None: ...

class ListWorkloadContractsReply(_message.Message):
    __slots__ = ("contracts", "budget", "min_reclamations", "no_spot_for_flagged")
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MIN_RECLAMATIONS_FIELD_NUMBER: _ClassVar[int]
    NO_SPOT_FOR_FLAGGED_FIELD_NUMBER: _ClassVar[int]
    contracts: _containers.RepeatedCompositeFieldContainer[WorkloadContract]
    budget: float
    min_reclamations: int
    no_spot_for_flagged: bool
    def __init__(self, contracts: _Optional[_Iterable[_Union[WorkloadContract, _Mapping]]] = ..., budget: _Optional[float] = ..., min_reclamations: _Optional[int] = ..., no_spot_for_flagged: _Optional[bool] = ...) -> None: ...

class StartWorkerRequest(_message.Message):
    __slots__ = ("node_id", "model", "image", "slots", "port", "kind")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: str
    image: str
    slots: int
    port: int
    kind: str
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[str] = ..., image: _Optional[str] = ..., slots: _Optional[int] = ..., port: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "node_id", "model", "image", "port", "capacity", "state", "gate_address", "slots_in_use", "drain_reason", "grace_deadline", "terminate_at", "kind")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GATE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TERMINATE_AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    model: str
    image: str
    port: int
    capacity: int
    state: str
    gate_address: str
    slots_in_use: int
    drain_reason: str
    grace_deadline: float
    terminate_at: float
    kind: str
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., model: _Optional[str] = ..., image: _Optional[str] = ..., port: _Optional[int] = ..., capacity: _Optional[int] = ..., state: _Optional[str] = ..., gate_address: _Optional[str] = ..., slots_in_use: _Optional[int] = ..., drain_reason: _Optional[str] = ..., grace_deadline: _Optional[float] = ..., terminate_at: _Optional[float] = ..., kind: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_id", "follow")
    FROM_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    from_id: int
    follow: bool
    def __init__(self, from_id: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class StoredEvent(_message.Message):
    __slots__ = ("id", "event", "received_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    id: int
    event: Event
    received_at: float
    def __init__(self, id: _Optional[int] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., received_at: _Optional[float] = ...) -> None: ...

class GetTimelineRequest(_message.Message):
    __slots__ = ("reclaim_id",)
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    reclaim_id: str
    def __init__(self, reclaim_id: _Optional[str] = ...) -> None: ...

class Reclamation(_message.Message):
    __slots__ = ("reclaim_id", "node_id", "notice_id", "reason", "source", "t0", "terminate_at", "grace_deadline", "overrun_at", "outcome", "spare_s", "steps")
    class StepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NOTICE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    T0_FIELD_NUMBER: _ClassVar[int]
    TERMINATE_AT_FIELD_NUMBER: _ClassVar[int]
    GRACE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_AT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SPARE_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    reclaim_id: str
    node_id: str
    notice_id: str
    reason: str
    source: str
    t0: float
    terminate_at: float
    grace_deadline: float
    overrun_at: float
    outcome: str
    spare_s: float
    steps: _containers.ScalarMap[str, float]
    def __init__(self, reclaim_id: _Optional[str] = ..., node_id: _Optional[str] = ..., notice_id: _Optional[str] = ..., reason: _Optional[str] = ..., source: _Optional[str] = ..., t0: _Optional[float] = ..., terminate_at: _Optional[float] = ..., grace_deadline: _Optional[float] = ..., overrun_at: _Optional[float] = ..., outcome: _Optional[str] = ..., spare_s: _Optional[float] = ..., steps: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Timeline(_message.Message):
    __slots__ = ("reclamation", "events")
    RECLAMATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    reclamation: Reclamation
    events: _containers.RepeatedCompositeFieldContainer[StoredEvent]
    def __init__(self, reclamation: _Optional[_Union[Reclamation, _Mapping]] = ..., events: _Optional[_Iterable[_Union[StoredEvent, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "gpus", "spot", "node_group", "connected", "last_seen", "taints", "workload_enabled", "provider", "live_workers", "active_rentals", "group_avoided_until", "managers", "cloud")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SPOT_FIELD_NUMBER: _ClassVar[int]
    NODE_GROUP_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    TAINTS_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_ENABLED_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RENTALS_FIELD_NUMBER: _ClassVar[int]
    GROUP_AVOIDED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    MANAGERS_FIELD_NUMBER: _ClassVar[int]
    CLOUD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    spot: bool
    node_group: str
    connected: bool
    last_seen: float
    taints: _containers.RepeatedCompositeFieldContainer[Taint]
    workload_enabled: bool
    provider: str
    live_workers: int
    active_rentals: int
    group_avoided_until: float
    managers: _containers.RepeatedCompositeFieldContainer[WorkManager]
    cloud: CloudIdentity
    def __init__(self, node_id: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., spot: _Optional[bool] = ..., node_group: _Optional[str] = ..., connected: _Optional[bool] = ..., last_seen: _Optional[float] = ..., taints: _Optional[_Iterable[_Union[Taint, _Mapping]]] = ..., workload_enabled: _Optional[bool] = ..., provider: _Optional[str] = ..., live_workers: _Optional[int] = ..., active_rentals: _Optional[int] = ..., group_avoided_until: _Optional[float] = ..., managers: _Optional[_Iterable[_Union[WorkManager, _Mapping]]] = ..., cloud: _Optional[_Union[CloudIdentity, _Mapping]] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class StreamContinued(_message.Message):
    __slots__ = ("request_id", "model", "from_worker_id", "to_worker_id", "chars", "tokens", "gap_s", "from_node_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHARS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAP_S_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    from_worker_id: str
    to_worker_id: str
    chars: int
    tokens: int
    gap_s: float
    from_node_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., from_worker_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ..., chars: _Optional[int] = ..., tokens: _Optional[int] = ..., gap_s: _Optional[float] = ..., from_node_id: _Optional[str] = ...) -> None: ...

class StreamContinuedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRoutesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("worker_id", "node_id", "model", "address", "slots_in_use", "capacity")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    model: str
    address: str
    slots_in_use: int
    capacity: int
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., model: _Optional[str] = ..., address: _Optional[str] = ..., slots_in_use: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class RouteUpdate(_message.Message):
    __slots__ = ("version", "snapshot", "upsert", "removed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    UPSERT_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    snapshot: bool
    upsert: _containers.RepeatedCompositeFieldContainer[Route]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., snapshot: _Optional[bool] = ..., upsert: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class PickWorkerRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Rental(_message.Message):
    __slots__ = ("rental_id", "node_id", "provider", "renter", "image", "gpus", "state", "started_at", "ended_at", "ended_by", "started_on_spot", "reclaim_at", "reclaim_id", "reclaim_reason", "exit_code", "detail")
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    RENTER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_FIELD_NUMBER: _ClassVar[int]
    STARTED_ON_SPOT_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_AT_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    node_id: str
    provider: str
    renter: str
    image: str
    gpus: int
    state: str
    started_at: float
    ended_at: float
    ended_by: str
    started_on_spot: bool
    reclaim_at: float
    reclaim_id: str
    reclaim_reason: str
    exit_code: int
    detail: str
    def __init__(self, rental_id: _Optional[str] = ..., node_id: _Optional[str] = ..., provider: _Optional[str] = ..., renter: _Optional[str] = ..., image: _Optional[str] = ..., gpus: _Optional[int] = ..., state: _Optional[str] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., ended_by: _Optional[str] = ..., started_on_spot: _Optional[bool] = ..., reclaim_at: _Optional[float] = ..., reclaim_id: _Optional[str] = ..., reclaim_reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class CreateRentalRequest(_message.Message):
    __slots__ = ("node_id", "image", "gpus", "renter")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RENTER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    image: str
    gpus: int
    renter: str
    def __init__(self, node_id: _Optional[str] = ..., image: _Optional[str] = ..., gpus: _Optional[int] = ..., renter: _Optional[str] = ...) -> None: ...

class GetRentalRequest(_message.Message):
    __slots__ = ("rental_id",)
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    def __init__(self, rental_id: _Optional[str] = ...) -> None: ...

class EndRentalRequest(_message.Message):
    __slots__ = ("rental_id", "ended_by")
    RENTAL_ID_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_FIELD_NUMBER: _ClassVar[int]
    rental_id: str
    ended_by: str
    def __init__(self, rental_id: _Optional[str] = ..., ended_by: _Optional[str] = ...) -> None: ...

class ListRentalsRequest(_message.Message):
    __slots__ = ("node_id", "active_only")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    active_only: bool
    def __init__(self, node_id: _Optional[str] = ..., active_only: _Optional[bool] = ...) -> None: ...

class ListRentalsReply(_message.Message):
    __slots__ = ("rentals",)
    RENTALS_FIELD_NUMBER: _ClassVar[int]
    rentals: _containers.RepeatedCompositeFieldContainer[Rental]
    def __init__(self, rentals: _Optional[_Iterable[_Union[Rental, _Mapping]]] = ...) -> None: ...
