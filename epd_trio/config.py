"""Configuration: one dataclass per component, and the one place where CLI flags
and ``EPD_*`` environment variables are mapped onto them.

Every field becomes a flag ``--field-name`` and a variable ``EPD_FIELD_NAME``.
Precedence: an explicit flag, then the variable, then the field's default.
The field's ``help`` metadata is the flag's help text and the README's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "EncoderConfig",
    "EngineConfig",
    "add_config_arguments",
    "config_from_args",
    "config_from_env",
    "env_name",
    "flag_name",
]

C = TypeVar("C")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """The in-process encoder engine: model, batching, preprocessing, media limits."""

    model_path: str | None = _opt(
        None, "local Hugging Face checkpoint directory of the full multimodal model "
        "(default: the embedded tiny random-weight qwen2_5_vl, generated on first use)")
    device: str = _opt("cpu", "torch device for the encoder (cpu, cuda, cuda:1)")
    dtype: str = _opt("auto", "auto (the checkpoint's), float32, bfloat16 or float16")
    max_batch_size: int = _opt(8, "most requests in one forward")
    max_batch_tokens: int = _opt(65536, "most output tokens in one forward (the oldest request always runs)")
    coalesce_delay: float = _opt(0.0, "seconds a non-full batch waits for company (0 = never)")
    max_pending: int = _opt(256, "admitted requests (preprocessing, queued or running); over it → 503")
    preprocess_workers: int = _opt(2, "threads preprocessing media in parallel with the forward")
    media_root: str | None = _opt(None, "directory local-path items may be read from (off by default)")
    max_image_pixels: int = _opt(40_000_000, "largest image (width × height) accepted, checked before decoding")
    max_item_bytes: int = _opt(64 * 1024 * 1024, "largest encoded media item in bytes (data URI, URL, file)")
    fetch_timeout: float = _opt(10.0, "seconds allowed to fetch one http(s) item")
    cache_dir: str | None = _opt(None, "where the embedded tiny model is generated "
                                 "(default: $XDG_CACHE_HOME/epd_trio or ~/.cache/epd_trio)")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "max_pending", "preprocess_workers",
                     "max_image_pixels", "max_item_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.coalesce_delay < 0 or self.fetch_timeout <= 0:
            raise ValueError("coalesce_delay must be >= 0 and fetch_timeout > 0")

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "epd_trio"


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder server: HTTP, request lifecycle deadlines, delivery. Holds its engine's config."""

    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on (0 picks a free one)")
    request_timeout: float = _opt(180.0, "seconds a request may live, from arrival to delivery (→ 504)")
    send_timeout: float = _opt(60.0, "seconds one delivery may take (ZMQ send, Mooncake /send wait) (→ 504)")
    health_timeout: float = _opt(30.0, "seconds the /health probe encode may take (→ 503)")
    health_fresh: float = _opt(5.0, "a batch completed this recently makes /health answer without a probe")
    drain_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on shutdown")
    max_body_bytes: int = _opt(128 * 1024 * 1024, "largest /encode body in bytes (→ 413)")
    max_items: int = _opt(256, "most mm_items in one request (→ 400)")
    zmq_idle_close: float = _opt(60.0, "seconds an unused ZMQ PUSH socket stays open")
    zmq_max_sockets: int = _opt(256, "most cached ZMQ PUSH sockets (one per destination)")
    transfer_backend: str = _opt("zmq", "zmq (inline and ZMQ delivery) or mooncake (also Mooncake "
                                 "transfer-engine writes; needs the mooncake extra)")
    mooncake_protocol: str = _opt("tcp", "Mooncake transport: tcp, or rdma where RDMA NICs exist")
    mooncake_device: str = _opt("", "Mooncake RDMA device names (e.g. mlx5_0), empty for tcp")
    mooncake_host: str | None = _opt(None, "address Mooncake peers reach this encoder at "
                                     "(default: --host, or 127.0.0.1 when that is 0.0.0.0)")
    log_level: str = _opt("INFO", "logging level")
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig, metadata={"nested": True})

    def __post_init__(self) -> None:
        for name in ("request_timeout", "send_timeout", "health_timeout", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.transfer_backend not in ("zmq", "mooncake"):
            raise ValueError(f"transfer_backend must be zmq or mooncake, got {self.transfer_backend!r}")
        if self.max_body_bytes < 1 or self.max_items < 1 or self.zmq_max_sockets < 1:
            raise ValueError("max_body_bytes, max_items and zmq_max_sockets must be at least 1")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return "EPD_" + field_name.upper()


def _base_type(annotation: Any) -> type:
    """``int | None`` → int; the parser for a field's values."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def _parse(raw: str, kind: type, name: str) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}") from None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of ``cls``; defaults stay None so env vars can fill in."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.metadata.get("nested"):
            add_config_arguments(parser, hints[f.name], skip=skip)
            continue
        kind = _base_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {f.default!r}]"
        if kind is bool:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif kind is tuple:
            group.add_argument(flag_name(f.name), dest=f.name, default=None, action="append",
                               help=help_text + " (repeatable)")
        else:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               type=lambda raw, k=kind, n=f.name: _parse(raw, k, n), help=help_text)


def config_from_env(cls: type[C], environ: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """``cls`` from ``EPD_*`` variables, then ``overrides`` (which win)."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("nested"):
            values[f.name] = config_from_env(hints[f.name], environ, **overrides)
            continue
        raw = environ.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _parse(raw, _base_type(hints[f.name]), env_name(f.name))
    own = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    values.update({k: v for k, v in overrides.items() if v is not None and k in own})
    return cls(**values)


def config_from_args(cls: type[C], args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> C:
    """``cls`` from parsed flags, falling back to ``EPD_*`` variables, then defaults."""
    explicit = {}
    for name, value in vars(args).items():
        if value is not None:
            explicit[name] = tuple(value) if isinstance(value, list) else value
    return config_from_env(cls, environ, **explicit)
