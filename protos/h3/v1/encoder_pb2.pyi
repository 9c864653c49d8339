from h3.v1 import common_pb2 as _common_pb2
from h3.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("prompt", "prompt_bytes", "job_id", "keyframes", "width", "height", "references", "frames", "ref_image_size")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYFRAMES_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    REF_IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_bytes: bytes
    job_id: str
    keyframes: _containers.RepeatedScalarFieldContainer[bytes]
    width: int
    height: int
    references: _containers.RepeatedCompositeFieldContainer[_common_pb2.Reference]
    frames: int
    ref_image_size: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_bytes: _Optional[bytes] = ..., job_id: _Optional[str] = ..., keyframes: _Optional[_Iterable[bytes]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., references: _Optional[_Iterable[_Union[_common_pb2.Reference, _Mapping]]] = ..., frames: _Optional[int] = ..., ref_image_size: _Optional[str] = ...) -> None: ...

class PromptCheckRequest(_message.Message):
    __slots__ = ("prompt", "prompt_bytes")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_bytes: bytes
    def __init__(self, prompt: _Optional[str] = ..., prompt_bytes: _Optional[bytes] = ...) -> None: ...

class PromptCheckReply(_message.Message):
    __slots__ = ("tokens", "max_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    max_tokens: int
    def __init__(self, tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class EncodeDone(_message.Message):
    __slots__ = ("tokens", "cache_hit", "timing", "model")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    cache_hit: bool
    timing: _common_pb2.Timing
    model: str
    def __init__(self, tokens: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class EncodeEvent(_message.Message):
    __slots__ = ("progress", "tensor", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    tensor: _tensor_pb2.TensorChunk
    done: EncodeDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[EncodeDone, _Mapping]] = ...) -> None: ...
