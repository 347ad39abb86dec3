"""Fault installation for the engine and its schedulers: ``media_load``, ``preprocess``, ``admission``, ``forward``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd_trio.testing import FaultPlan


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it belongs to this part; False if it does not."""
    # Transitional: until this part wraps its seams, it still has a ``faults`` slot.
    if not hasattr(owner, "faults"):
        return False
    owner.faults = plan
    return True
