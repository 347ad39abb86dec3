from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Item(_message.Message):
    __slots__ = ("url", "content_hash")
    URL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    url: str
    content_hash: str
    def __init__(self, url: _Optional[str] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("req_id", "modality", "mm_items", "num_parts", "part_idx", "hashes", "inline", "zmq", "mooncake")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_IDX_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    ZMQ_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    modality: str
    mm_items: _containers.RepeatedCompositeFieldContainer[Item]
    num_parts: int
    part_idx: int
    hashes: _containers.RepeatedScalarFieldContainer[str]
    inline: Inline
    zmq: Zmq
    mooncake: Mooncake
    def __init__(self, req_id: _Optional[str] = ..., modality: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., num_parts: _Optional[int] = ..., part_idx: _Optional[int] = ..., hashes: _Optional[_Iterable[str]] = ..., inline: _Optional[_Union[Inline, _Mapping]] = ..., zmq: _Optional[_Union[Zmq, _Mapping]] = ..., mooncake: _Optional[_Union[Mooncake, _Mapping]] = ...) -> None: ...

class Inline(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Zmq(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class Mooncake(_message.Message):
    __slots__ = ("receive_count",)
    RECEIVE_COUNT_FIELD_NUMBER: _ClassVar[int]
    receive_count: int
    def __init__(self, receive_count: _Optional[int] = ...) -> None: ...

class Grid(_message.Message):
    __slots__ = ("t", "h", "w")
    T_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    t: int
    h: int
    w: int
    def __init__(self, t: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ...) -> None: ...

class EncodeMeta(_message.Message):
    __slots__ = ("req_id", "part_idx", "num_parts", "modality", "tokens", "dim", "dtype", "token_counts", "grid_thw", "extras_json")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PART_IDX_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    part_idx: int
    num_parts: int
    modality: str
    tokens: int
    dim: int
    dtype: str
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    grid_thw: _containers.RepeatedCompositeFieldContainer[Grid]
    extras_json: str
    def __init__(self, req_id: _Optional[str] = ..., part_idx: _Optional[int] = ..., num_parts: _Optional[int] = ..., modality: _Optional[str] = ..., tokens: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., token_counts: _Optional[_Iterable[int]] = ..., grid_thw: _Optional[_Iterable[_Union[Grid, _Mapping]]] = ..., extras_json: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("meta", "safetensors", "nbytes")
    META_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    meta: EncodeMeta
    safetensors: bytes
    nbytes: int
    def __init__(self, meta: _Optional[_Union[EncodeMeta, _Mapping]] = ..., safetensors: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("req_id", "part_idx", "session", "buffer_address", "buffer_length")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PART_IDX_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    part_idx: int
    session: str
    buffer_address: int
    buffer_length: int
    def __init__(self, req_id: _Optional[str] = ..., part_idx: _Optional[int] = ..., session: _Optional[str] = ..., buffer_address: _Optional[int] = ..., buffer_length: _Optional[int] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("req_id", "part_idx", "nbytes")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PART_IDX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    part_idx: int
    nbytes: int
    def __init__(self, req_id: _Optional[str] = ..., part_idx: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("req_id", "part_idx")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PART_IDX_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    part_idx: int
    def __init__(self, req_id: _Optional[str] = ..., part_idx: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("req_id", "aborted", "released")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    aborted: int
    released: bool
    def __init__(self, req_id: _Optional[str] = ..., aborted: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayoutBlock(_message.Message):
    __slots__ = ("name", "width")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    width: int
    def __init__(self, name: _Optional[str] = ..., width: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_type", "modalities", "dim", "dtype", "device", "max_batch_size", "random_weights", "embedding_layout", "embedding_description", "version")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    modalities: _containers.RepeatedScalarFieldContainer[str]
    dim: int
    dtype: str
    device: str
    max_batch_size: int
    random_weights: bool
    embedding_layout: _containers.RepeatedCompositeFieldContainer[LayoutBlock]
    embedding_description: str
    version: str
    def __init__(self, model_type: _Optional[str] = ..., modalities: _Optional[_Iterable[str]] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., random_weights: _Optional[bool] = ..., embedding_layout: _Optional[_Iterable[_Union[LayoutBlock, _Mapping]]] = ..., embedding_description: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
