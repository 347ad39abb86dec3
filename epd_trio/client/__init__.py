"""The receiver library: ``open_encoder_client``, ``EmbeddingPool`` and routing.

``async with open_encoder_client(config) as client:`` then
``async with await client.encode({"image": [...]}) as result:``.
"""

from epd_trio.client.answers import RemoteEncodeError
from epd_trio.client.client import EncoderClient, open_encoder_client
from epd_trio.client.pool import EmbeddingPool, PoolStatistics, Slot
from epd_trio.client.result import EncodedRequest, ItemEmbedding
from epd_trio.client.routing import Part, plan_parts
from epd_trio.client.state import ClientStatistics
from epd_trio.client.vllm_parts import StoredRequest
from epd_trio.config import ClientConfig

__all__ = [
    "ClientConfig",
    "ClientStatistics",
    "EmbeddingPool",
    "EncodedRequest",
    "EncoderClient",
    "ItemEmbedding",
    "Part",
    "PoolStatistics",
    "RemoteEncodeError",
    "Slot",
    "StoredRequest",
    "open_encoder_client",
    "plan_parts",
]
