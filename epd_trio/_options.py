"""Options: how a config dataclass is read from flags and ``EPD_*`` variables, and shown.

Every field of the dataclasses in ``epd_trio.config`` becomes a flag ``--field-name`` and a
variable ``EPD_FIELD_NAME``. Precedence: an explicit flag, then the variable, then the field's
default. With ``--api sglang`` a field may also read SGLang's own variable for it
(``sglang_env`` in its metadata: ``SGLANG_ENCODER_REQ_TIMEOUT``,
``SGLANG_ENCODER_SEND_TIMEOUT``), below ours: flag, ``EPD_*``, ``SGLANG_*``, default.

A field's metadata says how it reads and shows: ``help`` (the flag's help text and the
meaning in docs/configuration.md), ``group`` (one of ``GROUPS``), ``choices``, ``size`` (a
byte count, also taken with a unit: ``128MiB``), ``metavar``, ``nested`` (a config inside).
``epd_trio.config`` re-exports what configuring needs; the help and docs tools use the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields
from decimal import Decimal
from typing import Any, TypeVar

__all__ = [
    "GROUPS",
    "add_config_arguments",
    "config_fields",
    "config_from_args",
    "config_from_env",
    "default_text",
    "env_name",
    "flag_name",
    "flag_usage",
    "grouped_fields",
    "parse_size",
]

C = TypeVar("C")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SIZE_UNITS = types.MappingProxyType({"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40})
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgt])i?b?|(b))?\s*", re.IGNORECASE)

# The option groups of --help and of docs/configuration.md, in the order shown. Every field
# names one (``_opt(..., group=...)``); tests/test_config.py holds every field to it.
GROUPS: Mapping[str, str] = types.MappingProxyType({
    "serving": "where it listens, which API it speaks, what a request may carry",
    "model": "the checkpoint, its device, how its forward runs",
    "batching": "admission, batching and the embedding cache",
    "preprocessing": "where and how media items become model inputs",
    "media": "limits on media items; fetching http(s) items",
    "delivery": "how embeddings reach the prefill side: ZMQ, Mooncake, SGLang's",
    "registry": "the bootstrap registry: registering, probing, discovering",
    "security": "tokens, and which media may be read or fetched",
    "client": "which encoders a client calls, how long it waits",
    "proxy": "the language servers the EPD proxy forwards requests to, and their health",
    "operations": "logging, health checks, shutdown, profiling, process tuning",
})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return "EPD_" + field_name.upper()


def config_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """``(field, type hint)`` of every setting of ``cls``, its nested configs' included."""
    hints = typing.get_type_hints(cls)
    found: list[tuple[dataclasses.Field[Any], Any]] = []
    for f in fields(cls):
        found += config_fields(hints[f.name]) if f.metadata.get("nested") else [(f, hints[f.name])]
    return found


def _base_type(annotation: Any) -> type:
    """``int | None`` → int; the parser for a field's values."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def _converter(f: dataclasses.Field[Any], hint: Any) -> Callable[[str], Any]:
    """How a flag's value or a variable becomes the field's value; ValueError names the fault."""
    kind = _base_type(hint)
    if f.metadata.get("size"):
        return parse_size
    if kind is bool:
        return _boolean
    if kind is tuple:
        return lambda raw: tuple(part.strip() for part in raw.split(",") if part.strip())

    def convert(raw: str) -> Any:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected {kind.__name__}, got {raw!r}") from None

    return convert


def _boolean(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {raw!r}")


def parse_size(raw: str) -> int:
    """Bytes: ``134217728``, or with a binary unit: ``512KiB``, ``128MiB``, ``1.5GiB`` (``K``,
    ``M``, ``G``, ``T`` with or without ``i``/``iB``/``B``, any case, all powers of 1024)."""
    match = _SIZE.fullmatch(raw)
    size = Decimal(match[1]) * _SIZE_UNITS[(match[2] or "").lower()] if match else None
    if size is None or size != int(size):
        raise ValueError(f"expected int, got {raw!r}: a size is whole bytes, or a number with a "
                         "unit (512KiB, 128MiB, 1GiB)")
    return int(size)


def _size_text(size: int) -> str:
    """``134217728`` → ``128MiB``: the largest unit that divides it (what parse_size takes)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as a user would type it; empty when it is unset (its help says what
    then happens)."""
    value = f.default
    if value is None or value == "" or value == () or value is dataclasses.MISSING:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if f.metadata.get("size"):
        return _size_text(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _flag_help(f: dataclasses.Field[Any], kind: type) -> str:
    env = env_name(f.name)
    if kind is tuple:
        env += ", comma-separated"
    if alias := f.metadata.get("sglang_env"):
        env += f"; with --api sglang also {alias}"
    default = default_text(f)
    return "".join((f.metadata.get("help", ""), " (repeatable)" if kind is tuple else "",
                    f" [default: {default}]" if default else "", f" [env: {env}]"))


def _metavar(f: dataclasses.Field[Any], kind: type) -> str:
    """What a flag's value is: its choices, SIZE, N, else the last word of its name (URL, DIR)."""
    if choices := f.metadata.get("choices"):
        return "{" + ",".join(choices) + "}"
    if f.metadata.get("size"):
        return "SIZE"
    return f.metadata.get("metavar") or ("N" if kind in (int, float) else f.name.rsplit("_", 1)[-1].upper())


def _flag_value(raw: str, convert: Callable[[str], Any]) -> Any:
    """A flag's value; argparse names the flag in front of the message."""
    try:
        return convert(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def grouped_fields(cls: type) -> dict[str, list[tuple[dataclasses.Field[Any], Any]]]:
    """The settings of ``cls`` by option group, in the order of ``GROUPS`` (a field without a
    group last, under "other"): the grouping of --help and of docs/configuration.md."""
    grouped: dict[str, list[tuple[dataclasses.Field[Any], Any]]] = {}
    for f, hint in config_fields(cls):
        grouped.setdefault(f.metadata.get("group", "other"), []).append((f, hint))
    return {title: grouped[title] for title in (*GROUPS, "other") if title in grouped}


def flag_usage(f: dataclasses.Field[Any], hint: Any) -> str:
    """How a setting is written on a command line: ``--port N``, ``--compile, --no-compile``."""
    kind = _base_type(hint)
    if kind is bool:
        return f"{flag_name(f.name)}, --no-{flag_name(f.name)[2:]}"
    return f"{flag_name(f.name)} {_metavar(f, kind)}"


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls``, in argument groups named as ``GROUPS``; defaults stay
    None so the variables can fill in."""
    for title, settings in grouped_fields(cls).items():
        settings = [(f, hint) for f, hint in settings if f.name not in skip]
        if not settings:
            continue
        group = parser.add_argument_group(title, GROUPS.get(title, "settings without a group"))
        for f, hint in settings:
            kind = _base_type(hint)
            common: dict[str, Any] = {"dest": f.name, "default": None,
                                      "help": _flag_help(f, kind).replace("%", "%%")}
            if kind is bool:
                group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **common)
            elif kind is tuple:
                group.add_argument(flag_name(f.name), action="append", metavar=_metavar(f, kind), **common)
            else:
                group.add_argument(flag_name(f.name), metavar=_metavar(f, kind),
                                   type=functools.partial(_flag_value, convert=_converter(f, hint)),
                                   **common)


def config_from_env(cls: type[C], environ: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """``cls`` from ``EPD_*`` variables, then ``overrides`` (which win)."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    sglang = (overrides.get("api") or environ.get(env_name("api"))) == "sglang"
    for f in fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("nested"):
            values[f.name] = config_from_env(hints[f.name], environ, **overrides)
            continue
        name = env_name(f.name)
        alias = f.metadata.get("sglang_env")
        if name not in environ and sglang and alias is not None and alias in environ:
            name = alias  # SGLang's own variable, below ours (os.environ refuses a None key)
        raw = environ.get(name)
        if raw is not None:
            try:
                values[f.name] = _converter(f, hints[f.name])(raw)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
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
