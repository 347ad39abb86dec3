"""Model adapters: what each model family's encoder is, and how to run it.

One module per family group (``qwen_vl``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL;
``qwen_audio``: Qwen2-Audio) over the common ``base``. ``adapter_for`` picks
the adapter from a checkpoint's ``config.model_type``.
"""

from __future__ import annotations

from typing import Any

from epd_trio.errors import ModelLoadError
from epd_trio.model.adapters.base import GridTHW, ModelAdapter, PreprocessResult
from epd_trio.model.adapters.qwen_audio import Qwen2AudioAdapter
from epd_trio.model.adapters.qwen_vl import Qwen2VLAdapter, Qwen3VLAdapter, Qwen25VLAdapter

__all__ = [
    "ADAPTERS",
    "GridTHW",
    "ModelAdapter",
    "PreprocessResult",
    "Qwen2AudioAdapter",
    "Qwen2VLAdapter",
    "Qwen3VLAdapter",
    "Qwen25VLAdapter",
    "adapter_for",
]

ADAPTERS: dict[str, type[ModelAdapter]] = {
    cls.family: cls for cls in (Qwen2VLAdapter, Qwen25VLAdapter, Qwen3VLAdapter, Qwen2AudioAdapter)
}


def adapter_for(config: Any) -> ModelAdapter:
    """The adapter for a checkpoint's config; unknown families name the supported ones."""
    family = getattr(config, "model_type", None)
    try:
        cls = ADAPTERS[family]  # type: ignore[index]
    except KeyError:
        raise ModelLoadError(
            f"unsupported model family {family!r}; supported: {', '.join(sorted(ADAPTERS))}"
        ) from None
    return cls(config)
