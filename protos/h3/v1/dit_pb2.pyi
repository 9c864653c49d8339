from h3.v1 import common_pb2 as _common_pb2
from h3.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleRequest(_message.Message):
    __slots__ = ("params", "job_id", "loras")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    params: _common_pb2.RenderParams
    job_id: str
    loras: _containers.RepeatedCompositeFieldContainer[LoraSpec]
    def __init__(self, params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., job_id: _Optional[str] = ..., loras: _Optional[_Iterable[_Union[LoraSpec, _Mapping]]] = ...) -> None: ...

class LoraSpec(_message.Message):
    __slots__ = ("name", "strength")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    strength: float
    def __init__(self, name: _Optional[str] = ..., strength: _Optional[float] = ...) -> None: ...

class SampleInput(_message.Message):
    __slots__ = ("request", "tensor")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    request: SampleRequest
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, request: _Optional[_Union[SampleRequest, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class SampleDone(_message.Message):
    __slots__ = ("timing", "ms_per_step", "world_size", "cached_steps", "windows", "sparse_steps")
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_STEPS_FIELD_NUMBER: _ClassVar[int]
    timing: _common_pb2.Timing
    ms_per_step: float
    world_size: int
    cached_steps: int
    windows: str
    sparse_steps: int
    def __init__(self, timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., ms_per_step: _Optional[float] = ..., world_size: _Optional[int] = ..., cached_steps: _Optional[int] = ..., windows: _Optional[str] = ..., sparse_steps: _Optional[int] = ...) -> None: ...

class SampleEvent(_message.Message):
    __slots__ = ("progress", "tensor", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    tensor: _tensor_pb2.TensorChunk
    done: SampleDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[SampleDone, _Mapping]] = ...) -> None: ...
