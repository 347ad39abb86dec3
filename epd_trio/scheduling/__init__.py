"""Batching policy (pure), the scheduler loop and the device worker thread."""
