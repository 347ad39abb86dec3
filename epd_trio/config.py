"""Configuration: one dataclass per component, every field documented and checked.

Every field is also a flag and an ``EPD_*`` environment variable; ``epd_trio._options``
maps them (``add_config_arguments``, ``config_from_args``, ``config_from_env``, re-exported
here), in option groups (``GROUPS``), from each field's metadata: its ``help``, ``group``
and, where they apply, ``choices`` (the values taken: shown in --help and checked here) and
``size`` (bytes, also taken with a unit).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from epd_trio._options import (
    GROUPS,
    GiB,
    KiB,
    MiB,
    add_config_arguments,
    config_from_args,
    config_from_env,
    env_name,
    flag_name,
)

__all__ = [
    "BootstrapConfig",
    "EcTransfer",
    "ClientConfig",
    "EncoderConfig",
    "EngineConfig",
    "ProxyConfig",
    "add_config_arguments",
    "available_cores",
    "check_log_level",
    "config_from_args",
    "config_from_env",
    "env_name",
    "flag_name",
    "parse_ec_transfer_config",
]

APIS = ("native", "sglang", "vllm")
SGLANG_BACKENDS = ("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake")
ENCODER_BACKENDS = ("zmq", "mooncake")
CLIENT_BACKENDS = ("zmq", "mooncake", "inline")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
HTTP_SERVERS = ("builtin", "hypercorn")  # as epd_trio._listen serves them
_HTTP_SERVER_HELP = ("the HTTP server: builtin (epd_trio's lean HTTP/1.1 server on h11) or hypercorn "
                     "(Hypercorn's HTTP/1.1 protocol on epd_trio's connection handling)")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREPROCESS_MODES = ("thread", "process")
EC_CONNECTORS = ("ECExampleConnector", "ECMooncakeConnector")  # the vLLM EC connectors served
EC_STORAGE_DEFAULT = "/tmp"  # vLLM's ECExampleConnector default shared_storage_path
EC_MOONCAKE_PROTOCOL = "rdma"  # vLLM's ECMooncakeConnector default mooncake_protocol
EC_CONTROL_TIMEOUT = 30.0  # vLLM's ECMooncakeConnector default control_timeout_s
MM_HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # vLLM's --mm-hasher-algorithm
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LOG_METAVAR = "{" + ",".join(LOG_LEVELS) + "}"
MAX_THREADS = 1024  # torch threads of one forward or worker: far past any core count, short of a crash
_DEVICE = re.compile(r"cpu(?::0)?|cuda(?::[0-9]{1,3})?")
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _opt(default: Any, help: str, *, group: str | None = None, secret: bool = False, **kw: Any) -> Any:
    """A config field in one of ``GROUPS``; a ``secret`` one is kept out of the dataclass's
    repr (and so out of logs). ``choices``: the values taken, shown and checked; ``size``: a
    byte count, also taken with a unit (``128MiB``)."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}: one of {', '.join(GROUPS)}")
    meta = {"help": help, **kw} | ({"group": group} if group else {})
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """The in-process encoder engine: model, batching, preprocessing, media limits."""

    model_path: str | None = _opt(
        None, "local Hugging Face checkpoint directory of the full multimodal model (default: the "
        "embedded tiny random-weight qwen2_5_vl, generated on first use)", group="model")
    device: str = _opt("cpu", "torch device for the encoder (cpu, cuda, cuda:1); a comma-separated "
                       "list (cuda:0,cuda:1) runs one worker per device behind one admission bound "
                       "(data parallel)", group="model")
    dtype: str = _opt("auto", "dtype of the encoder's weights; auto: the checkpoint's own",
                      group="model", choices=DTYPES)
    compile: bool = _opt(False, "torch.compile the encoder's forward (dynamic shapes; the first "
                         "batches of each new size are slow while it compiles)", group="model")
    cpu_threads: int = _opt(0, "torch intra-op threads of each forward on a CPU device (0 = the "
                            "cores this process may use, shared among the CPU workers); "
                            "ignored on GPUs", group="model")
    preprocess_threads: int = _opt(1, "torch intra-op threads of each preprocessing worker, thread or "
                                   "process (1: no OpenMP team of its own competing with the forward)",
                                   group="preprocessing")
    max_batch_size: int = _opt(8, "most requests in one forward", group="batching")
    max_batch_tokens: int = _opt(65536, "most output tokens in one forward (the oldest request always "
                                 "runs)", group="batching")
    coalesce_delay: float = _opt(0.0, "seconds a non-full batch waits for company (0 = never)",
                                 group="batching")
    adaptive_batch: bool = _opt(True, "learn, per device and modality, the tokens per forward past "
                                "which throughput stops growing, and batch no further than that "
                                "(re-measured now and then; --max-batch-size and "
                                "--max-batch-tokens stay the ceilings); off: batches fill to "
                                "the ceilings", group="batching")
    max_pending: int = _opt(256, "admitted requests (preprocessing, queued or running); over it → 503",
                            group="batching")
    preprocess_workers: int = _opt(2, "preprocessing workers running in parallel with the forward "
                                   "(threads, or processes with --preprocess-mode process)",
                                   group="preprocessing")
    media_root: str | None = _opt(None, "directory local-path items may be read from (default: "
                                  "none, local paths are refused)", group="security")
    max_image_pixels: int = _opt(40_000_000, "largest image (width × height) accepted, checked "
                                 "before decoding", group="media")
    max_item_bytes: int = _opt(64 * MiB, "largest encoded media item (data URI, URL, file)",
                               group="media", size=True)
    fetch_timeout: float = _opt(10.0, "seconds allowed to fetch one http(s) item", group="media")
    max_request_pixels: int = _opt(160_000_000, "most pixels of all images of one request together, "
                                   "checked on their headers before any is decoded", group="media")
    fetch_allow_hosts: tuple[str, ...] = _opt((), "hosts http(s) items may be fetched from "
                                              "(example.com also allows its subdomains); empty: "
                                              "any (the address rules still apply)", group="security")
    fetch_deny_private: bool = _opt(False, "also refuse http(s) items and redirects to loopback, "
                                    "private and other non-global addresses (cloud-metadata and "
                                    "link-local ones are refused always), names checked by what "
                                    "they resolve to", group="security")
    max_redirects: int = _opt(3, "redirects followed when fetching an item (each hop checked by "
                              "the same rules)", group="media")
    video_fps: float = _opt(2.0, "frames per second sampled from a video file (by the model's own "
                            "sampling rule); a list of frames counts as sampled at this rate",
                            group="preprocessing")
    video_min_frames: int = _opt(4, "fewest frames sampled from a video file", group="preprocessing")
    video_max_frames: int = _opt(768, "most frames sampled from a video file, or given as a list",
                                 group="preprocessing")
    max_video_seconds: float = _opt(3600.0, "longest video file accepted, in seconds "
                                    "(checked on the container before decoding)", group="media")
    max_video_frames: int = _opt(200_000, "most frames a video file may have in its source "
                                 "(before sampling)", group="media")
    max_video_pixels: int = _opt(768 * 1280 * 720, "most pixels (frames × width × height) of the "
                                 "frames one video gives the model", group="media")
    max_audio_seconds: float = _opt(30.0, "longest audio item accepted, in seconds (never cut; "
                                    "the model's own window is a second bound)", group="media")
    cache_dir: str | None = _opt(None, "where the embedded tiny model is generated "
                                 "(default: $XDG_CACHE_HOME/epd_trio or ~/.cache/epd_trio)", group="model")
    cache_mb: int = _opt(0, "host memory for the embedding cache in MiB: items seen before (by "
                         "their hashes entry, else their content) skip preprocessing and the "
                         "forward; LRU by bytes; 0 = off", group="batching")
    preprocess_mode: str = _opt("thread", "thread: preprocess in --preprocess-workers threads of the "
                                "encoder process; process: in a pool of --preprocess-workers "
                                "spawned processes (tensors come back through shared memory)",
                                group="preprocessing", choices=PREPROCESS_MODES)
    preprocess_device: str | None = _opt(None, "torch device the image processor runs on (cpu, cuda, "
                                         "cuda:1; on CUDA a JPEG is decoded there too, on the "
                                         "preprocessing thread's own stream); default: the "
                                         "processor's own CPU path", group="preprocessing")
    null_forward: bool = _opt(False, "BENCHMARKING ONLY: skip the model's forward and answer zeros "
                              "of the right shape and dtype (token counts from the model's own "
                              "processor), so a benchmark measures everything but the model; the "
                              "weights are still loaded", group="model")

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.preprocess_mode == "process" and self.preprocess_device not in (None, "cpu"):
            raise ValueError("preprocess_mode process runs on the CPU: it cannot take "
                             f"preprocess_device {self.preprocess_device!r}")
        _require(self, lambda v: v >= 1, "at least 1", "max_batch_size", "max_batch_tokens",
                 "max_pending", "preprocess_workers", "max_image_pixels", "max_item_bytes",
                 "video_min_frames", "max_video_frames", "max_video_pixels", "preprocess_threads")
        _require(self, lambda v: v >= 0, ">= 0", "cache_mb", "cpu_threads", "coalesce_delay",
                 "max_redirects")
        _require(self, lambda v: v <= MAX_THREADS, f"at most {MAX_THREADS}", "cpu_threads",
                 "preprocess_threads")
        if "cpu" in (d.split(":")[0] for d in self.devices):  # elsewhere cpu_threads is ignored
            cores = available_cores()
            _require(self, lambda v: v <= cores, f"at most the {cores} CPUs this process may use "
                     "on a CPU device", "cpu_threads")
        _require(self, lambda v: v > 0, "> 0", "fetch_timeout", "video_fps", "max_video_seconds",
                 "max_audio_seconds")
        for device in self.devices:
            _check_device(device, "device")
        if self.preprocess_device is not None:
            _check_device(self.preprocess_device, "preprocess_device")
        if self.video_max_frames < self.video_min_frames:
            raise ValueError(f"video_max_frames ({self.video_max_frames}) must be at least "
                             f"video_min_frames ({self.video_min_frames})")
        if self.media_root is not None and not Path(self.media_root).is_dir():
            raise ValueError(f"{_named('media_root')} must be an existing directory, got {self.media_root!r}")

    @property
    def devices(self) -> tuple[str, ...]:
        """One entry per worker: ``"cuda:0,cuda:1"`` → ``("cuda:0", "cuda:1")``."""
        return tuple(d.strip() for d in self.device.split(","))

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "epd_trio"


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder server: HTTP, request lifecycle deadlines, delivery. Holds its engine's config."""

    host: str = _opt("127.0.0.1", "address to listen on", group="serving")
    port: int = _opt(8000, "port to listen on (0 picks a free one)", group="serving")
    grpc_port: int | None = _opt(None, "also serve gRPC on this port (0 picks a free one), on the "
                                 "same host and runtime: SGLang's SglangEncoder, epd_trio.v1.Encoder, "
                                 "grpc.health.v1 and reflection; default: no gRPC", group="serving")
    api: str = _opt("native", "the HTTP face: native (epd_trio's protocol v1), sglang (SGLang "
                    "0.5.23's encoder routes and bodies, a drop-in for its --encoder-only server) "
                    "or vllm (vLLM 0.32's EPD encoder instance: OpenAI /v1/chat/completions, "
                    "embeddings to vLLM's EC connector; needs --ec-transfer-config)",
                    group="serving", choices=APIS)
    encoder_transfer_backend: str = _opt("zmq_to_scheduler", "with --api sglang, how embeddings "
                                         "reach SGLang (SGLang's own flag and values)",
                                         group="delivery", choices=SGLANG_BACKENDS)
    sglang_max_early_calls: int = _opt(4096, "with --api sglang, most /scheduler_receive_url and "
                                       "/scheduler_receive_meta_data calls (gRPC: SchedulerReceiveUrl, "
                                       "Send) waiting at once for parts no delivery holds yet (their "
                                       "/encode not come or not yet preprocessed) (→ 503)",
                                       group="delivery")
    ec_transfer_config: str | None = _opt(
        None, "with --api vllm, vLLM's own --ec-transfer-config JSON for an encoder instance: "
        "ec_role ec_producer, and ec_connector ECExampleConnector (ec_connector_extra_config."
        "shared_storage_path, default /tmp) or ECMooncakeConnector (mooncake_protocol, default "
        "rdma; control_timeout_s, default 30), with vLLM's defaults", group="delivery")
    vllm_model: str | None = _opt(
        None, "with --api vllm, the vLLM language server's --model string exactly as it was given "
        "there: it enters every item's mm_hash, so it must equal the consumer's (default: "
        "--model-path as given)", group="serving")
    served_model_name: str | None = _opt(
        None, "with --api vllm, the model name requests may carry and /v1/models lists (vLLM's "
        "--served-model-name; default: --vllm-model)", group="serving")
    mm_hasher_algorithm: str = _opt("blake3", "with --api vllm, the consumer's --mm-hasher-algorithm",
                                    group="delivery", choices=MM_HASH_ALGORITHMS)
    request_timeout: float = _opt(180.0, "seconds a request may live, from arrival to delivery (→ 504)",
                                  group="serving", sglang_env="SGLANG_ENCODER_REQ_TIMEOUT")
    send_timeout: float = _opt(60.0, "seconds one delivery may take (ZMQ send, Mooncake /send wait) "
                               "(→ 504)", group="delivery", sglang_env="SGLANG_ENCODER_SEND_TIMEOUT")
    health_timeout: float = _opt(30.0, "seconds the /health probe encode may take (→ 503)",
                                 group="operations")
    health_fresh: float = _opt(5.0, "a batch completed this recently makes /health answer without a "
                               "probe", group="operations")
    drain_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on shutdown",
                                group="operations")
    max_body_bytes: int = _opt(128 * MiB, "largest /encode body (→ 413)", group="serving", size=True)
    max_items: int = _opt(256, "most mm_items in one request (→ 400)", group="serving")
    zmq_idle_close: float = _opt(60.0, "seconds an unused ZMQ PUSH socket stays open", group="delivery")
    zmq_max_sockets: int = _opt(256, "most cached ZMQ PUSH sockets (one per destination)",
                                group="delivery")
    zmq_sndhwm: int = _opt(64, "messages queued per ZMQ destination before a send waits (each "
                           "holds its embedding's memory: this bounds what a receiver that stops "
                           "reading pins, and its sends time out after --send-timeout)", group="delivery")
    transfer_backend: str = _opt("zmq", "how the native face delivers: zmq (inline and ZMQ) or "
                                 "mooncake (also Mooncake transfer-engine writes; needs the mooncake "
                                 "extra)", group="delivery", choices=ENCODER_BACKENDS)
    mooncake_protocol: str = _opt("tcp", "Mooncake transport: rdma where RDMA NICs exist",
                                  group="delivery", choices=MOONCAKE_PROTOCOLS)
    mooncake_device: str = _opt("", "Mooncake RDMA device names (e.g. mlx5_0); empty for tcp",
                                group="delivery")
    mooncake_host: str | None = _opt(None, "address Mooncake peers reach this encoder at "
                                     "(default: --host, or when that is 0.0.0.0 or :: the "
                                     "advertised URL's host)", group="delivery")
    register_url: tuple[str, ...] = _opt((), "bootstrap registry URL to register this encoder with",
                                         group="registry")
    advertise_url: str | None = _opt(None, "URL registries and clients reach this encoder at "
                                     "(default: the bound http://host:port; a wildcard host becomes "
                                     "this host's address on the route to the first --register-url "
                                     "registry on another host, else this machine's hostname; "
                                     "loopback told to a registry on another host is refused at "
                                     "start)", group="registry")
    heartbeat_interval: float = _opt(30.0, "seconds between re-announcements to each registry "
                                     "(a restarted registry is refilled within one)", group="registry")
    registry_auth_token: str | None = _opt(None, "bearer token for the registries' register and "
                                           "unregister calls (prefer the variable: flags show in ps)",
                                           group="security", secret=True)
    auth_token: str | None = _opt(None, "bearer token the admin endpoints (/abort, profiling) need; "
                                  "prefer the variable: flags show in ps", group="security", secret=True)
    require_auth_for_encode: bool = _opt(False, "also require the auth token on /encode and /send",
                                         group="security")
    max_header_bytes: int = _opt(16 * KiB, "largest HTTP request head (request line + headers) "
                                 "accepted", group="serving", size=True)
    http_server: str = _opt("builtin", _HTTP_SERVER_HELP, group="serving", choices=HTTP_SERVERS)
    profile_dir: str | None = _opt(None, "directory POST /start_profile writes Chrome traces under "
                                   "(a request's output_dir must lie inside it; default: a new "
                                   "temporary directory)", group="operations")
    log_level: str = _opt("INFO", "logging level (any case)", group="operations", metavar=_LOG_METAVAR)
    cpu_keep_freed_memory: bool = _opt(True, "with a CPU device, glibc's malloc keeps freed memory "
                                       "for the next batch instead of handing it back to the "
                                       "kernel, which would zero its pages again (the heap keeps "
                                       "its high-water mark); process-wide, so applied by "
                                       "epd-trio encoder once serving (embedders: "
                                       "epd_trio.engine.heap.keep_freed_memory)", group="operations")
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig, metadata={"nested": True})

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self, lambda v: v > 0, "> 0", "request_timeout", "send_timeout", "health_timeout",
                 "drain_timeout", "heartbeat_interval", "zmq_idle_close")
        _require(self, lambda v: v >= 0, ">= 0", "health_fresh")
        _check_listen(self.host, self.port)
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"{_named('grpc_port')} must be in 0..65535, got {self.grpc_port}")
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"{_named('grpc_port')} must differ from {_named('port')}: both are {self.port}")
        _check_vllm(self)
        _require(self, lambda v: v >= 1, "at least 1", "max_body_bytes", "max_items", "zmq_max_sockets",
                 "zmq_sndhwm", "sglang_max_early_calls")
        _require(self, lambda v: v <= _INT32_MAX, f"at most {_INT32_MAX} (libzmq's int)", "zmq_sndhwm")
        check_log_level(self.log_level)
        if self.profile_dir is not None and Path(self.profile_dir).exists() \
                and not Path(self.profile_dir).is_dir():
            raise ValueError(f"{_named('profile_dir')} must be a directory, got the file {self.profile_dir!r}")
        _check_token("registry_auth_token", self.registry_auth_token)
        _check_token("auth_token", self.auth_token)
        if self.require_auth_for_encode and not self.auth_token:
            raise ValueError("require_auth_for_encode needs an auth_token")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if isinstance(self.register_url, str):
            raise ValueError("register_url must be a sequence of URLs, not one string")
        object.__setattr__(self, "register_url",
                           tuple(dict.fromkeys(_url(u, "register_url") for u in self.register_url)))
        if self.advertise_url is not None:
            object.__setattr__(self, "advertise_url", _url(self.advertise_url, "advertise_url"))

    @property
    def vllm_ec(self) -> EcTransfer | None:
        """With --api vllm, its parsed --ec-transfer-config; else None."""
        if self.api != "vllm" or self.ec_transfer_config is None:
            return None
        return parse_ec_transfer_config(self.ec_transfer_config)

    @property
    def vllm_storage_path(self) -> str | None:
        """With --api vllm and ECExampleConnector, its shared-storage directory; else None."""
        ec = self.vllm_ec
        return ec.storage_path if ec is not None else None

    @property
    def uses_mooncake(self) -> bool:
        """Whether this encoder opens a Mooncake transfer engine (any face may ask for one)."""
        if self.api == "sglang":
            return self.encoder_transfer_backend == "mooncake"
        ec = self.vllm_ec
        if ec is not None:
            return ec.mooncake_protocol is not None
        return self.transfer_backend == "mooncake"

    @property
    def effective_mooncake_protocol(self) -> str:
        """The transfer engine's protocol: vLLM's JSON names it for ECMooncakeConnector."""
        ec = self.vllm_ec
        if ec is not None and ec.mooncake_protocol is not None:
            return ec.mooncake_protocol
        return self.mooncake_protocol


@dataclass(frozen=True)
class BootstrapConfig:
    """The bootstrap registry: encoders register with it, clients ask it for the healthy ones."""

    host: str = _opt("127.0.0.1", "address to listen on", group="serving")
    port: int = _opt(8997, "port to listen on (0 picks a free one)", group="serving")
    health_interval: float = _opt(10.0, "seconds between health rounds (GET /health on every encoder, "
                                  "concurrently)", group="registry")
    health_timeout: float = _opt(2.0, "seconds one health probe may take before it counts as missed",
                                 group="registry")
    max_failures: int = _opt(3, "consecutive missed probes that evict an encoder from the list",
                             group="registry")
    evicted_ttl: float = _opt(600.0, "seconds an evicted encoder is still probed (and revived when "
                              "healthy) before it is forgotten", group="registry")
    max_encoders: int = _opt(1024, "most encoders the registry holds, healthy or evicted (each is probed "
                             "every round); a registration over it → 503", group="registry")
    auth_token: str | None = _opt(None, "bearer token that register and unregister calls must carry "
                                  "(default: none needed; prefer the variable: flags show in ps)",
                                  group="security", secret=True)
    http_server: str = _opt("builtin", _HTTP_SERVER_HELP, group="serving", choices=HTTP_SERVERS)
    log_level: str = _opt("INFO", "logging level (any case)", group="operations", metavar=_LOG_METAVAR)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self, lambda v: v > 0, "> 0", "health_interval", "health_timeout", "evicted_ttl")
        _check_listen(self.host, self.port)
        _require(self, lambda v: v >= 1, "at least 1", "max_failures", "max_encoders")
        _check_token("auth_token", self.auth_token)
        check_log_level(self.log_level)


@dataclass(frozen=True)
class EcTransfer:
    """The parts of vLLM's ``--ec-transfer-config`` this encoder acts on.

    ECExampleConnector sets ``storage_path``; ECMooncakeConnector sets
    ``mooncake_protocol`` and ``control_timeout`` (the other is None).
    """

    connector: str
    role: str
    storage_path: str | None
    mooncake_protocol: str | None = None
    control_timeout: float | None = None


def parse_ec_transfer_config(raw: str) -> EcTransfer:
    """vLLM's ``--ec-transfer-config`` JSON; ``ValueError`` says what is wrong with it."""
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"ec_transfer_config (--ec-transfer-config) is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("ec_transfer_config (--ec-transfer-config) must be a JSON object")
    connector, role = config.get("ec_connector"), config.get("ec_role")
    if connector not in EC_CONNECTORS:
        raise ValueError(f"ec_transfer_config: ec_connector must be one of {', '.join(EC_CONNECTORS)}, "
                         f"got {connector!r}")
    if role != "ec_producer":
        raise ValueError(f"ec_transfer_config: an encoder's ec_role is ec_producer, got {role!r}")
    extra = config.get("ec_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("ec_transfer_config: ec_connector_extra_config must be a JSON object")
    if connector == "ECMooncakeConnector":
        return _mooncake_ec(connector, role, extra)
    path = extra.get("shared_storage_path", EC_STORAGE_DEFAULT)
    if not isinstance(path, str) or not path:
        raise ValueError("ec_transfer_config: ec_connector_extra_config.shared_storage_path must be "
                         "a directory path")
    return EcTransfer(connector, role, path)


def _mooncake_ec(connector: str, role: str, extra: dict[str, Any]) -> EcTransfer:
    """ECMooncakeConnector's producer settings, with vLLM's defaults and checks."""
    protocol = extra.get("mooncake_protocol", EC_MOONCAKE_PROTOCOL)
    if protocol not in MOONCAKE_PROTOCOLS:  # the transports --mooncake-protocol takes too
        raise ValueError("ec_transfer_config: ec_connector_extra_config.mooncake_protocol must be "
                         f"one of {', '.join(MOONCAKE_PROTOCOLS)}, got {protocol!r}")
    timeout = extra.get("control_timeout_s", EC_CONTROL_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise ValueError("ec_transfer_config: ec_connector_extra_config.control_timeout_s must be a "
                         f"number > 0, got {timeout!r}")
    if extra.get("cross_encoder_cache", False) is not False:
        raise ValueError("ec_transfer_config: cross_encoder_cache (vLLM's Mooncake Store) is not "
                         "supported by this encoder")
    return EcTransfer(connector, role, None, protocol, float(timeout))


def _check_vllm(config: EncoderConfig) -> None:
    """--api vllm needs vLLM's --ec-transfer-config (checked here, before minutes of loading)."""
    if config.api != "vllm":
        return
    if config.ec_transfer_config is None:
        raise ValueError("--api vllm needs ec_transfer_config (--ec-transfer-config): vLLM's JSON "
                         "naming the EC connector and its storage")
    parse_ec_transfer_config(config.ec_transfer_config)


def _named(name: str) -> str:
    """A field as both its users know it: ``max_items (--max-items)``."""
    return f"{name} ({flag_name(name)})"


def _require(config: Any, ok: Callable[[Any], bool], rule: str, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not ok(value):
            raise ValueError(f"{_named(name)} must be {rule}, got {value!r}")


def _check_fields(config: Any) -> None:
    """Every number finite and within 64 bits: NaN passes every ``<=`` check (a NaN timeout
    would crash the first wait on it), and a larger int overflows where torch takes it.
    Every field with ``choices`` holds one of them."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_named(f.name)} must be a finite number, got {value}")
        if isinstance(value, int) and not -_INT64_MAX <= value <= _INT64_MAX:
            raise ValueError(f"{_named(f.name)} must fit in 64 bits, got {value}")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{_named(f.name)} must be one of {', '.join(choices)}, got {value!r}")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _check_device(device: str, name: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:N``: the devices this project runs and tests on (whether the
    CUDA device exists is checked where the engine starts)."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"{_named(name)} must be cpu, cuda or cuda:N (a comma-separated list for "
                         f"--device), got {device!r}")


def check_log_level(level: str) -> None:
    """A level ``logging`` takes (``warn``, ``notset`` too), whatever its case."""
    if level.upper() not in logging.getLevelNamesMapping():
        raise ValueError(f"log_level (--log-level, EPD_LOG_LEVEL) must be one of "
                         f"{', '.join(LOG_LEVELS)}, got {level!r}")


def _check_listen(host: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{_named('port')} must be in 0..65535, got {port}")
    if not host or host.startswith("[") or any(ch.isspace() for ch in host):
        raise ValueError(f"{_named('host')} must be an address or name to listen on (an IPv6 address without "
                         f"brackets, '0.0.0.0' or '::' for all), got {host!r}")


def _check_token(name: str, token: str | None) -> None:
    if token is not None and not (token.isascii() and token.isprintable() and token and " " not in token):
        raise ValueError(f"{name} must be non-empty printable ASCII without spaces (unset it to disable)")


def _url(raw: str, name: str) -> str:
    from epd_trio.errors import RequestError
    from epd_trio.protocol.urls import normalize_url

    try:
        return normalize_url(raw, name)
    except RequestError as exc:
        raise ValueError(exc.message) from None


def _encoder_urls(urls: tuple[str, ...]) -> tuple[str, ...]:
    """A client's own encoder list, normalized and without repeats (the port may be left off)."""
    from epd_trio.errors import RequestError
    from epd_trio.protocol.urls import ENCODER_SCHEMES, normalize_url

    try:
        return tuple(dict.fromkeys(normalize_url(url, "encoder URL", schemes=ENCODER_SCHEMES,
                                                 require_port=False) for url in urls))
    except RequestError as exc:
        raise ValueError(exc.message) from None


def _dns_url(raw: str) -> str:
    """``discovery_dns``: an http:// or grpc:// URL with a host name and a port, no path (each
    address it resolves to becomes ``scheme://address:port``; https would fail its certificate
    check on a bare address)."""
    from epd_trio.errors import RequestError
    from epd_trio.protocol.urls import normalize_url

    try:
        url = normalize_url(raw, "discovery_dns", schemes=("http", "grpc"))
    except RequestError as exc:
        raise ValueError(exc.message) from None
    host_and_port = url.split("://", 1)[1]
    if "/" in host_and_port:
        raise ValueError(f"discovery_dns must have no path, got {raw!r}")
    return url


@dataclass(frozen=True)
class ClientConfig:
    """The encoder client: which encoders, where embeddings arrive, deadlines, pool size."""

    encoder_urls: tuple[str, ...] = _opt((), "encoder base URLs (http://host:port, or grpc://host:port "
                                         "for the native gRPC service)", group="client")
    zmq_bind: str | None = _opt(
        None, "where the client's ZMQ PULL socket binds (port 0 picks a free one; a wildcard host, "
        "0.0.0.0 or [::], tells each encoder this host's address on the route to it); default: "
        "bound on first need to this host's address on the route to each encoder, a free port each",
        group="delivery")
    zmq_advertise: str | None = _opt(
        None, "the endpoint every encoder pushes to (port 0 here means the bound port), for NAT; "
        "needs zmq_bind; default: the bound one", group="delivery")
    timeout: float = _opt(60.0, "seconds one encode may take end to end, pool wait included "
                          "(→ EncodeTimeout)", group="client")
    connect_timeout: float = _opt(5.0, "seconds to connect to an encoder before trying another one",
                                  group="client")
    abort_timeout: float = _opt(2.0, "seconds the best-effort /abort of a failed request's other parts "
                                "may take", group="client")
    abort_hold: float = _opt(180.0, "seconds a failed Mooncake request's pool slot stays held when an "
                             "encoder did not confirm its /abort (a late write may still land there)",
                             group="client")
    pool_bytes: int = _opt(GiB, "size of the host embedding pool (one buffer, allocated at start)",
                           group="delivery", size=True)
    bootstrap_url: str | None = _opt(None, "a bootstrap registry to discover encoders from "
                                     "(merged with encoder_urls)", group="registry")
    discovery_dns: str | None = _opt(
        None, "an encoder URL whose host name stands for every encoder: each of its A/AAAA "
        "records is one (http://encoders.ns.svc:8000 for a Kubernetes headless Service, or "
        "grpc://...); resolved every refresh_interval and merged with the other sources",
        group="registry")
    refresh_interval: float = _opt(5.0, "seconds between refreshes of the registry's and the DNS "
                                   "name's encoder lists (in the background, never on a request's "
                                   "path)", group="registry")
    registry_timeout: float = _opt(2.0, "seconds one registry query (or resolution of "
                                   "discovery_dns) may take", group="registry")
    transfer_backend: str = _opt("zmq", "how embeddings arrive: zmq (pushed to the client's PULL "
                                 "socket), mooncake (written straight into the registered pool; "
                                 "needs the mooncake extra) or inline (in the HTTP answers: no "
                                 "sockets of its own; simple set-ups and in-process tests)",
                                 group="delivery", choices=CLIENT_BACKENDS)
    mooncake_host: str | None = _opt(
        None, "address encoders' Mooncake engines reach this client at; default: this host's "
        "address on the route to the first peer it knows on another host (encoder_urls, "
        "bootstrap_url, discovery_dns), loopback when there is none", group="delivery")
    mooncake_protocol: str = _opt("tcp", "Mooncake transport: rdma where RDMA NICs exist",
                                  group="delivery", choices=MOONCAKE_PROTOCOLS)
    mooncake_device: str = _opt("", "Mooncake RDMA device names (e.g. mlx5_0); empty for tcp",
                                group="delivery")

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self, lambda v: v > 0, "> 0", "timeout", "connect_timeout", "abort_timeout",
                 "abort_hold", "refresh_interval", "registry_timeout")
        _require(self, lambda v: v >= 1, "at least 1", "pool_bytes")
        # Normalized as a registry's list is, so the two merge: one encoder, one string.
        object.__setattr__(self, "encoder_urls", _encoder_urls(self.encoder_urls))
        if self.zmq_advertise and not self.zmq_bind:
            raise ValueError("zmq_advertise needs zmq_bind: the address and port the PULL socket "
                             "listens on (encoders are told zmq_advertise)")
        if self.discovery_dns is not None:
            object.__setattr__(self, "discovery_dns", _dns_url(self.discovery_dns))


def _http_urls(urls: tuple[str, ...], what: str) -> tuple[str, ...]:
    """http(s) base URLs, normalized and without repeats (the port may be left off); an
    entry may hold several, comma-separated (as a flag given once)."""
    from epd_trio.errors import RequestError
    from epd_trio.protocol.urls import normalize_url

    if isinstance(urls, str):
        raise ValueError(f"{what} must be a sequence of URLs, not one string")
    split = [url.strip() for entry in urls for url in entry.split(",") if url.strip()]
    try:
        return tuple(dict.fromkeys(normalize_url(url, what, require_port=False) for url in split))
    except RequestError as exc:
        raise ValueError(exc.message) from None


@dataclass(frozen=True)
class ProxyConfig:
    """The EPD proxy: a request's media to encoder instances, then the request to a vLLM server."""

    host: str = _opt("127.0.0.1", "address to listen on", group="serving")
    port: int = _opt(8000, "port to listen on (0 picks a free one)", group="serving")
    encoder_urls: tuple[str, ...] = _opt((), "encoder instances (http://host:port): epd-trio "
                                         "encoders started with --api vllm, or vLLM's own "
                                         "(ec_role ec_producer); several comma-separated too",
                                         group="client")
    bootstrap_url: str | None = _opt(None, "a bootstrap registry to discover encoders from "
                                     "(merged with --encoder-urls; register only --api vllm ones "
                                     "there)", group="registry")
    prefill_decode_urls: tuple[str, ...] = _opt((), "the language servers requests are forwarded "
                                                "to (vLLM, ec_role ec_consumer); several "
                                                "comma-separated too; at least one", group="proxy")
    encode_timeout: float = _opt(60.0, "seconds the encoders get to store a request's media, "
                                 "failovers included (→ 504)", group="client")
    upstream_timeout: float = _opt(600.0, "seconds a forwarded request may take, from the "
                                   "encoders' end to its answer's last byte, streams included "
                                   "(→ 504 before the answer starts; after, the stream ends)",
                                   group="proxy")
    connect_timeout: float = _opt(5.0, "seconds to connect to an encoder or a language server "
                                  "before trying another one", group="client")
    health_interval: float = _opt(5.0, "seconds between health probes (GET /health) of each "
                                  "language server", group="proxy")
    health_timeout: float = _opt(2.0, "seconds one health probe may take before it counts as missed",
                                 group="proxy")
    max_failures: int = _opt(2, "consecutive missed probes that take a language server out of "
                             "rotation (one answered probe brings it back)", group="proxy")
    refresh_interval: float = _opt(5.0, "seconds between refreshes of the registry's encoder list",
                                   group="registry")
    max_body_bytes: int = _opt(128 * MiB, "largest request body (→ 413)", group="serving", size=True)
    body_timeout: float = _opt(60.0, "seconds a request body may take to arrive (→ 408)",
                               group="serving")
    max_requests: int = _opt(1024, "most requests in flight at once; over it → 503 at once",
                             group="serving")
    http_server: str = _opt("builtin", _HTTP_SERVER_HELP, group="serving", choices=HTTP_SERVERS)
    log_level: str = _opt("INFO", "logging level (any case)", group="operations", metavar=_LOG_METAVAR)

    def __post_init__(self) -> None:
        _check_fields(self)
        _check_listen(self.host, self.port)
        _require(self, lambda v: v > 0, "> 0", "encode_timeout", "upstream_timeout",
                 "connect_timeout", "health_interval", "health_timeout", "refresh_interval",
                 "body_timeout")
        _require(self, lambda v: v >= 1, "at least 1", "max_failures", "max_body_bytes",
                 "max_requests")
        check_log_level(self.log_level)
        object.__setattr__(self, "encoder_urls", _http_urls(self.encoder_urls, "encoder_urls"))
        urls = _http_urls(self.prefill_decode_urls, "prefill_decode_urls")
        if not urls:
            raise ValueError(f"{_named('prefill_decode_urls')} needs at least one language server URL")
        object.__setattr__(self, "prefill_decode_urls", urls)
        if not self.encoder_urls and not self.bootstrap_url:
            raise ValueError(f"name the encoders: {_named('encoder_urls')} or {_named('bootstrap_url')}")
        if self.bootstrap_url is not None:
            object.__setattr__(self, "bootstrap_url", _url(self.bootstrap_url, "bootstrap_url"))

    def client_config(self) -> ClientConfig:
        """The encoder client behind the fan-out: nothing comes back to its pool, so a small one."""
        return ClientConfig(encoder_urls=self.encoder_urls, bootstrap_url=self.bootstrap_url,
                            refresh_interval=self.refresh_interval, timeout=self.encode_timeout,
                            connect_timeout=self.connect_timeout, transfer_backend="inline",
                            pool_bytes=MiB)
