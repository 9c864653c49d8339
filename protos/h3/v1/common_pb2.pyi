from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RenderParams(_message.Message):
    __slots__ = ("prompt", "width", "height", "frames", "steps", "seed", "sampler", "scheduler", "video_shift", "audio_shift", "quality", "window_frames", "window_overlap", "window_mode", "window_fuse", "more_prompts", "prompt_starts", "prefix_frames", "sparse_attention", "ref_image_size")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    VIDEO_SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SHIFT_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FUSE_FIELD_NUMBER: _ClassVar[int]
    MORE_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_STARTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    REF_IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    width: int
    height: int
    frames: int
    steps: int
    seed: int
    sampler: str
    scheduler: str
    video_shift: float
    audio_shift: float
    quality: str
    window_frames: int
    window_overlap: int
    window_mode: str
    window_fuse: str
    more_prompts: _containers.RepeatedScalarFieldContainer[str]
    prompt_starts: _containers.RepeatedScalarFieldContainer[float]
    prefix_frames: int
    sparse_attention: SparseAttention
    ref_image_size: str
    def __init__(self, prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., frames: _Optional[int] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., sampler: _Optional[str] = ..., scheduler: _Optional[str] = ..., video_shift: _Optional[float] = ..., audio_shift: _Optional[float] = ..., quality: _Optional[str] = ..., window_frames: _Optional[int] = ..., window_overlap: _Optional[int] = ..., window_mode: _Optional[str] = ..., window_fuse: _Optional[str] = ..., more_prompts: _Optional[_Iterable[str]] = ..., prompt_starts: _Optional[_Iterable[float]] = ..., prefix_frames: _Optional[int] = ..., sparse_attention: _Optional[_Union[SparseAttention, _Mapping]] = ..., ref_image_size: _Optional[str] = ...) -> None: ...

class SparseAttention(_message.Message):
    __slots__ = ("method", "keep_percent", "start_percent", "end_percent", "dense_blocks", "min_tokens")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    KEEP_PERCENT_FIELD_NUMBER: _ClassVar[int]
    START_PERCENT_FIELD_NUMBER: _ClassVar[int]
    END_PERCENT_FIELD_NUMBER: _ClassVar[int]
    DENSE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    method: str
    keep_percent: float
    start_percent: float
    end_percent: float
    dense_blocks: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    def __init__(self, method: _Optional[str] = ..., keep_percent: _Optional[float] = ..., start_percent: _Optional[float] = ..., end_percent: _Optional[float] = ..., dense_blocks: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("stage", "phase", "step", "total", "elapsed_s", "eta_s", "step_ms", "message")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    phase: str
    step: int
    total: int
    elapsed_s: float
    eta_s: float
    step_ms: float
    message: str
    def __init__(self, stage: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., eta_s: _Optional[float] = ..., step_ms: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "lease_wait_s", "load_s", "compute_s", "unload_s", "transfer_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    lease_wait_s: float
    load_s: float
    compute_s: float
    unload_s: float
    transfer_s: float
    def __init__(self, queue_s: _Optional[float] = ..., lease_wait_s: _Optional[float] = ..., load_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., unload_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KernelChoice(_message.Message):
    __slots__ = ("op", "kernel", "reason")
    OP_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    op: str
    kernel: str
    reason: str
    def __init__(self, op: _Optional[str] = ..., kernel: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LifecycleReply(_message.Message):
    __slots__ = ("resident", "seconds", "message")
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    resident: bool
    seconds: float
    message: str
    def __init__(self, resident: _Optional[bool] = ..., seconds: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "health", "resident", "devices", "world_size", "weights", "variant", "memory_bytes", "queue_depth", "running", "lease_holder", "residency", "kernels", "embedded_model", "jobs_done", "partitions", "loras", "device_ids", "host", "changed_weight_files", "models_dir")
    class PartitionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ChangedWeightFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_MODEL_FIELD_NUMBER: _ClassVar[int]
    JOBS_DONE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CHANGED_WEIGHT_FILES_FIELD_NUMBER: _ClassVar[int]
    MODELS_DIR_FIELD_NUMBER: _ClassVar[int]
    stage: str
    health: str
    resident: bool
    devices: _containers.RepeatedScalarFieldContainer[str]
    world_size: int
    weights: str
    variant: str
    memory_bytes: int
    queue_depth: int
    running: int
    lease_holder: str
    residency: str
    kernels: _containers.RepeatedCompositeFieldContainer[KernelChoice]
    embedded_model: bool
    jobs_done: int
    partitions: _containers.ScalarMap[str, str]
    loras: LoraCatalog
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    host: str
    changed_weight_files: _containers.ScalarMap[str, str]
    models_dir: str
    def __init__(self, stage: _Optional[str] = ..., health: _Optional[str] = ..., resident: _Optional[bool] = ..., devices: _Optional[_Iterable[str]] = ..., world_size: _Optional[int] = ..., weights: _Optional[str] = ..., variant: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., lease_holder: _Optional[str] = ..., residency: _Optional[str] = ..., kernels: _Optional[_Iterable[_Union[KernelChoice, _Mapping]]] = ..., embedded_model: _Optional[bool] = ..., jobs_done: _Optional[int] = ..., partitions: _Optional[_Mapping[str, str]] = ..., loras: _Optional[_Union[LoraCatalog, _Mapping]] = ..., device_ids: _Optional[_Iterable[str]] = ..., host: _Optional[str] = ..., changed_weight_files: _Optional[_Mapping[str, str]] = ..., models_dir: _Optional[str] = ...) -> None: ...

class LoraCatalog(_message.Message):
    __slots__ = ("directory", "names", "paths_allowed")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PATHS_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    directory: str
    names: _containers.RepeatedScalarFieldContainer[str]
    paths_allowed: bool
    def __init__(self, directory: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., paths_allowed: _Optional[bool] = ...) -> None: ...

class Reference(_message.Message):
    __slots__ = ("kind", "data", "name", "thumbnail", "seconds", "width", "height", "digest")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    THUMBNAIL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    kind: str
    data: bytes
    name: str
    thumbnail: bytes
    seconds: float
    width: int
    height: int
    digest: str
    def __init__(self, kind: _Optional[str] = ..., data: _Optional[bytes] = ..., name: _Optional[str] = ..., thumbnail: _Optional[bytes] = ..., seconds: _Optional[float] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Guide(_message.Message):
    __slots__ = ("frame", "image", "audio")
    FRAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    frame: int
    image: Reference
    audio: Reference
    def __init__(self, frame: _Optional[int] = ..., image: _Optional[_Union[Reference, _Mapping]] = ..., audio: _Optional[_Union[Reference, _Mapping]] = ...) -> None: ...
