"""Sans-IO wire protocol v1: headers, validation, msgpack and safetensors codecs.

Nothing here imports trio or reads a clock; the transports adapt it.
"""

from epd_trio.protocol.codec import (
    decode_safetensors,
    decode_zmq_message,
    dtype_name,
    encode_safetensors,
    encode_zmq_message,
    error_message,
    header_for,
    tensor_bytes,
)
from epd_trio.protocol.messages import (
    DTYPES,
    MODALITIES,
    PROTOCOL_VERSION,
    EmbeddingHeader,
    ErrorInfo,
    header_from_map,
    header_to_map,
)
from epd_trio.protocol.payload import PAYLOAD_FRAME_BYTES, Payload

__all__ = [
    "DTYPES",
    "EmbeddingHeader",
    "ErrorInfo",
    "MODALITIES",
    "PAYLOAD_FRAME_BYTES",
    "Payload",
    "PROTOCOL_VERSION",
    "decode_safetensors",
    "decode_zmq_message",
    "dtype_name",
    "encode_safetensors",
    "encode_zmq_message",
    "error_message",
    "header_for",
    "header_from_map",
    "header_to_map",
    "tensor_bytes",
]
