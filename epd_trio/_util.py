"""Small helpers shared across the package."""

from __future__ import annotations

__all__ = ["first_leaf"]


def first_leaf(group: BaseException) -> BaseException:
    """The first non-group exception of a (nested) exception group.

    Child tasks fail one at a time in practice; the caller wants that error,
    typed, not the group trio wraps it in.
    """
    exc = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
