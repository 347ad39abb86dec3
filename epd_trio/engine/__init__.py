"""The in-process encoder engine: media → preprocessing → batched forward, with an embedding cache.

``core`` holds the ``Engine`` and ``open_engine``; ``plan`` decides, per
request, which items need a forward and builds the answer; ``cache`` is the
per-item embedding LRU the plan consults.
"""

from epd_trio.engine.cache import CacheStatistics, EmbeddingCache
from epd_trio.engine.core import Engine, EngineStatistics, ModelInfo, open_engine
from epd_trio.engine.plan import EncodeOutput

__all__ = [
    "CacheStatistics",
    "EmbeddingCache",
    "EncodeOutput",
    "Engine",
    "EngineStatistics",
    "ModelInfo",
    "open_engine",
]
