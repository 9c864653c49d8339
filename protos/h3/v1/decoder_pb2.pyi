from h3.v1 import common_pb2 as _common_pb2
from h3.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MP4: _ClassVar[OutputFormat]
    RAW: _ClassVar[OutputFormat]
    WAV: _ClassVar[OutputFormat]
MP4: OutputFormat
RAW: OutputFormat
WAV: OutputFormat

class DecodeRequest(_message.Message):
    __slots__ = ("params", "job_id", "format", "crf", "output_name", "upscale_width", "upscale_height", "prefix_digest")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CRF_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NAME_FIELD_NUMBER: _ClassVar[int]
    UPSCALE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    UPSCALE_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    params: _common_pb2.RenderParams
    job_id: str
    format: OutputFormat
    crf: int
    output_name: str
    upscale_width: int
    upscale_height: int
    prefix_digest: str
    def __init__(self, params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., job_id: _Optional[str] = ..., format: _Optional[_Union[OutputFormat, str]] = ..., crf: _Optional[int] = ..., output_name: _Optional[str] = ..., upscale_width: _Optional[int] = ..., upscale_height: _Optional[int] = ..., prefix_digest: _Optional[str] = ...) -> None: ...

class DecodeInput(_message.Message):
    __slots__ = ("request", "tensor")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class DecodeDone(_message.Message):
    __slots__ = ("timing", "frames", "audio_samples", "world_size")
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    timing: _common_pb2.Timing
    frames: int
    audio_samples: int
    world_size: int
    def __init__(self, timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., frames: _Optional[int] = ..., audio_samples: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("progress", "file", "tensor", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    file: _tensor_pb2.FileChunk
    tensor: _tensor_pb2.TensorChunk
    done: DecodeDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., file: _Optional[_Union[_tensor_pb2.FileChunk, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[DecodeDone, _Mapping]] = ...) -> None: ...

class RawImage(_message.Message):
    __slots__ = ("width", "height", "rgb")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    RGB_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    rgb: bytes
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., rgb: _Optional[bytes] = ...) -> None: ...

class EncodeImageRequest(_message.Message):
    __slots__ = ("image", "pixels", "width", "height", "job_id")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    pixels: RawImage
    width: int
    height: int
    job_id: str
    def __init__(self, image: _Optional[bytes] = ..., pixels: _Optional[_Union[RawImage, _Mapping]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class EncodeImageDone(_message.Message):
    __slots__ = ("timing", "width", "height")
    TIMING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    timing: _common_pb2.Timing
    width: int
    height: int
    def __init__(self, timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class EncodeImageEvent(_message.Message):
    __slots__ = ("progress", "tensor", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    tensor: _tensor_pb2.TensorChunk
    done: EncodeImageDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[EncodeImageDone, _Mapping]] = ...) -> None: ...

class EncodeReferenceRequest(_message.Message):
    __slots__ = ("reference", "frames", "job_id", "ref_image_size", "width", "height")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REF_IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    reference: _common_pb2.Reference
    frames: int
    job_id: str
    ref_image_size: str
    width: int
    height: int
    def __init__(self, reference: _Optional[_Union[_common_pb2.Reference, _Mapping]] = ..., frames: _Optional[int] = ..., job_id: _Optional[str] = ..., ref_image_size: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class EncodeReferenceDone(_message.Message):
    __slots__ = ("timing", "width", "height", "frames", "seconds", "source_fps", "source_rate")
    TIMING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FPS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RATE_FIELD_NUMBER: _ClassVar[int]
    timing: _common_pb2.Timing
    width: int
    height: int
    frames: int
    seconds: float
    source_fps: float
    source_rate: int
    def __init__(self, timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., frames: _Optional[int] = ..., seconds: _Optional[float] = ..., source_fps: _Optional[float] = ..., source_rate: _Optional[int] = ...) -> None: ...

class EncodeReferenceEvent(_message.Message):
    __slots__ = ("progress", "tensor", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    tensor: _tensor_pb2.TensorChunk
    done: EncodeReferenceDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[EncodeReferenceDone, _Mapping]] = ...) -> None: ...

class EncodeTailRequest(_message.Message):
    __slots__ = ("digest", "params", "job_id")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    digest: str
    params: _common_pb2.RenderParams
    job_id: str
    def __init__(self, digest: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.RenderParams, _Mapping]] = ..., job_id: _Optional[str] = ...) -> None: ...
