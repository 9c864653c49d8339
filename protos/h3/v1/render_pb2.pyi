from h3.v1 import common_pb2 as _common_pb2
from h3.v1 import dit_pb2 as _dit_pb2
from h3.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_QUEUED: _ClassVar[JobState]
    JOB_RUNNING: _ClassVar[JobState]
    JOB_SUCCEEDED: _ClassVar[JobState]
    JOB_FAILED: _ClassVar[JobState]
    JOB_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_QUEUED: JobState
JOB_RUNNING: JobState
JOB_SUCCEEDED: JobState
JOB_FAILED: JobState
JOB_CANCELLED: JobState

class RenderRequest(_message.Message):
    __slots__ = ("params", "loras", "crf", "first_frame", "last_frame", "upscale_width", "upscale_height", "idempotency_key", "label", "references", "workflow_json", "workflow_set", "output_format", "guides", "extend_job_id")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    CRF_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    LAST_FRAME_FIELD_NUMBER: _ClassVar[int]
    UPSCALE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    UPSCALE_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_SET_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    GUIDES_FIELD_NUMBER: _ClassVar[int]
    EXTEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    params: _common_pb2.RenderParams
    loras: _containers.RepeatedCompositeFieldContainer[_dit_pb2.LoraSpec]
    crf: int
    first_frame: bytes
    last_frame: bytes
    upscale_width: int
    upscale_height: int
    idempotency_key: str
    label: str
    references: _containers.RepeatedCompositeFieldContainer[_common_pb2.Reference]
    workflow_json: str
    workflow_set: _containers.RepeatedScalarFieldContainer[str]
    output_format: str
    guides: _containers.RepeatedCompositeFieldContainer[_common_pb2.Guide]
    extend_job_id: str
    def __init__(self, params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., loras: _Optional[_Iterable[_Union[_dit_pb2.LoraSpec, _Mapping]]] = ..., crf: _Optional[int] = ..., first_frame: _Optional[bytes] = ..., last_frame: _Optional[bytes] = ..., upscale_width: _Optional[int] = ..., upscale_height: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., label: _Optional[str] = ..., references: _Optional[_Iterable[_Union[_common_pb2.Reference, _Mapping]]] = ..., workflow_json: _Optional[str] = ..., workflow_set: _Optional[_Iterable[str]] = ..., output_format: _Optional[str] = ..., guides: _Optional[_Iterable[_Union[_common_pb2.Guide, _Mapping]]] = ..., extend_job_id: _Optional[str] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("job_id", "params", "idempotency_key", "label", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    params: _common_pb2.RenderParams
    idempotency_key: str
    label: str
    seconds: float
    def __init__(self, job_id: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., label: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class StageRun(_message.Message):
    __slots__ = ("stage", "wall_s", "timing", "batch", "batch_size", "waited_batches", "replica", "cached_steps", "sparse_steps")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CACHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_STEPS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    wall_s: float
    timing: _common_pb2.Timing
    batch: int
    batch_size: int
    waited_batches: int
    replica: str
    cached_steps: int
    sparse_steps: int
    def __init__(self, stage: _Optional[str] = ..., wall_s: _Optional[float] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., batch: _Optional[int] = ..., batch_size: _Optional[int] = ..., waited_batches: _Optional[int] = ..., replica: _Optional[str] = ..., cached_steps: _Optional[int] = ..., sparse_steps: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "state", "params", "stage", "progress", "attempts", "created_unix", "started_unix", "finished_unix", "error_code", "error", "output_bytes", "output_expired", "events", "stages", "label", "width", "height", "queue_position", "references", "windows", "extend_job_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    params: _common_pb2.RenderParams
    stage: str
    progress: _common_pb2.Progress
    attempts: int
    created_unix: float
    started_unix: float
    finished_unix: float
    error_code: str
    error: str
    output_bytes: int
    output_expired: bool
    events: int
    stages: _containers.RepeatedCompositeFieldContainer[StageRun]
    label: str
    width: int
    height: int
    queue_position: int
    references: _containers.RepeatedCompositeFieldContainer[_common_pb2.Reference]
    windows: str
    extend_job_id: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., stage: _Optional[str] = ..., progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., attempts: _Optional[int] = ..., created_unix: _Optional[float] = ..., started_unix: _Optional[float] = ..., finished_unix: _Optional[float] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., output_bytes: _Optional[int] = ..., output_expired: _Optional[bool] = ..., events: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageRun, _Mapping]]] = ..., label: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., queue_position: _Optional[int] = ..., references: _Optional[_Iterable[_Union[_common_pb2.Reference, _Mapping]]] = ..., windows: _Optional[str] = ..., extend_job_id: _Optional[str] = ...) -> None: ...

class RenderEvent(_message.Message):
    __slots__ = ("job_id", "index", "time_unix", "job", "progress", "file")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    index: int
    time_unix: float
    job: JobInfo
    progress: _common_pb2.Progress
    file: _tensor_pb2.FileChunk
    def __init__(self, job_id: _Optional[str] = ..., index: _Optional[int] = ..., time_unix: _Optional[float] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., file: _Optional[_Union[_tensor_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "from_index")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_index: int
    def __init__(self, job_id: _Optional[str] = ..., from_index: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("states", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[JobState, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("job_id", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class StageEndpoint(_message.Message):
    __slots__ = ("stage", "endpoint", "health", "status")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    endpoint: str
    health: str
    status: _common_pb2.StageStatus
    def __init__(self, stage: _Optional[str] = ..., endpoint: _Optional[str] = ..., health: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.StageStatus, _Mapping]] = ...) -> None: ...

class RenderStatus(_message.Message):
    __slots__ = ("health", "queued", "running", "succeeded", "failed", "cancelled", "batches", "stages", "web_url", "max_batch", "max_wait_batches", "stage_groups")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    WEB_URL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STAGE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    health: str
    queued: int
    running: int
    succeeded: int
    failed: int
    cancelled: int
    batches: int
    stages: _containers.RepeatedCompositeFieldContainer[StageEndpoint]
    web_url: str
    max_batch: int
    max_wait_batches: int
    stage_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, health: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., succeeded: _Optional[int] = ..., failed: _Optional[int] = ..., cancelled: _Optional[int] = ..., batches: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageEndpoint, _Mapping]]] = ..., web_url: _Optional[str] = ..., max_batch: _Optional[int] = ..., max_wait_batches: _Optional[int] = ..., stage_groups: _Optional[_Iterable[str]] = ...) -> None: ...
