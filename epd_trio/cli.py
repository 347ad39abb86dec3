"""The ``epd-trio`` command: one subcommand per thing an operator runs."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import trio

from epd_trio._help import CommandParser
from epd_trio._util import leaves
from epd_trio._version import __version__
from epd_trio.config import (
    ENCODER_BACKENDS,
    BootstrapConfig,
    EncoderConfig,
    EngineConfig,
    ProxyConfig,
    add_config_arguments,
    check_log_level,
    config_from_args,
)
from epd_trio.errors import EPDError

__all__ = ["main"]

log = logging.getLogger(__name__)

# Expected start-up failures: a bad flag, a missing checkpoint, a port in use.
# Only these become a one-line message and exit 2; anything else is a bug.
_EXPECTED = (EPDError, ValueError)
EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C (128 + SIGINT)
Served = EncoderConfig | BootstrapConfig | ProxyConfig  # what `_serve_until_signal` serves


def _make_tiny_model(args: argparse.Namespace) -> int:
    from epd_trio.model.tiny import TinySpec, is_tiny_model, make_tiny_model

    if not args.directory:
        raise ValueError("make-tiny-model needs a directory to write into")
    out = Path(args.directory)
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{args.directory!r} is a file, not a directory")
        if out.is_dir() and any(out.iterdir()) and not is_tiny_model(out):
            # never write random weights over someone's checkpoint
            raise ValueError(f"{args.directory!r} holds files that are no tiny model: "
                             "name a new or empty directory")
        path = make_tiny_model(out, TinySpec(arch=args.arch, seed=args.seed))
    except OSError as exc:
        raise ValueError(f"cannot write a tiny model to {args.directory!r}: {exc.strerror or exc}") from None
    print(f"wrote a tiny RANDOM-WEIGHT {args.arch} checkpoint to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from epd_trio.demo import run_demo

    print(trio.run(run_demo, config_from_args(EngineConfig, args), args.encoders, args.transfer_backend))
    return 0


def _encoder(args: argparse.Namespace) -> int:
    config = config_from_args(EncoderConfig, args)
    logging.getLogger().setLevel(config.log_level.upper())
    trio.run(_serve_until_signal, config)
    return 0


def _freeze_startup_objects() -> None:
    """Leave what start-up made (torch, transformers, the model: ~4e5 objects for the
    embedded model) out of every later garbage collection. Each request makes a few hundred
    short-lived objects; without this, a full collection walks the whole heap on the trio
    thread (~0.4 s on a 2-core machine, every request waiting). The process is the CLI's
    own: a program that embeds an encoder decides this for itself."""
    gc.collect()
    gc.freeze()


def _tune_process(config: Served) -> bool:
    """What only the process's owner may set: on a CPU device, malloc keeps freed memory
    (``engine.heap``: a CPU forward's activations are asked for again every batch). Once
    serving, so what loading the model freed has gone back to the kernel. True when applied."""
    if not isinstance(config, EncoderConfig) or not config.cpu_keep_freed_memory:
        return False
    if all(d.split(":")[0] != "cpu" for d in config.engine.devices):
        return False
    from epd_trio.engine.heap import keep_freed_memory

    return keep_freed_memory()


async def _serve_until_signal(config: Served) -> None:
    """Serve until SIGINT/SIGTERM, then leave the block: a graceful shutdown, exit 0.

    The signal is watched from the start: one that comes while the server is
    still starting (loading the model, say) cancels the start-up, whose
    blocking calls are abandonable or bounded, so the process exits promptly.
    """
    what = {EncoderConfig: "encoder", BootstrapConfig: "bootstrap", ProxyConfig: "proxy"}[type(config)]
    # Watched before the server's imports (torch, transformers: seconds), which a signal
    # during them must stop too: trio keeps it until the first checkpoint after them.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        started, stop = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as starting:
                nursery.start_soon(_first_signal, signals, started, stop, starting, what)
                async with _serve_function(config)(config) as server:
                    started.set()
                    _freeze_startup_objects()
                    _tune_process(config)
                    print(f"epd-trio {what} listening on {server.url}", flush=True)
                    if getattr(server, "grpc", None) is not None:
                        print(f"epd-trio {what} serving gRPC on {server.grpc.url}", flush=True)
                    await stop.wait()
                    log.info("shutting the %s down gracefully", what)
            if starting.cancelled_caught:
                log.info("the %s stopped before it had started", what)
            nursery.cancel_scope.cancel()


def _serve_function(config: Served) -> Any:
    if isinstance(config, EncoderConfig):
        from epd_trio.encoder.server import serve_encoder

        return serve_encoder
    if isinstance(config, ProxyConfig):
        from epd_trio.proxy.server import serve_proxy

        return serve_proxy
    from epd_trio.bootstrap.server import serve_bootstrap

    return serve_bootstrap


async def _first_signal(signals: AsyncIterator[int], started: trio.Event, stop: trio.Event,
                        starting: trio.CancelScope, what: str) -> None:
    """The first signal cancels a start-up still under way, or ends the serving block."""
    async for signum in signals:
        log.info("%s: stopping the %s", signal.Signals(signum).name, what)
        if started.is_set():
            stop.set()
        else:
            starting.cancel()
        return


def _bootstrap(args: argparse.Namespace) -> int:
    config = config_from_args(BootstrapConfig, args)
    logging.getLogger().setLevel(config.log_level.upper())
    trio.run(_serve_until_signal, config)
    return 0


def _proxy(args: argparse.Namespace) -> int:
    config = config_from_args(ProxyConfig, args)
    logging.getLogger().setLevel(config.log_level.upper())
    trio.run(_serve_until_signal, config)
    return 0


# Each command's description and examples; the examples' indented lines are kept as written.
_MAIN: Mapping[str, Any] = MappingProxyType({
    "description": ("The multimodal encoder of Encode-Prefill-Decode disaggregated LLM serving: it "
                    "turns images, videos and audio into embeddings and delivers them to the "
                    "prefill side."),
    "epilog": """examples:
  # an encoder of the embedded tiny random-weight model on 127.0.0.1:8000
  epd-trio encoder
  # a registry, encoders and a client in one program, on the same model
  epd-trio demo

epd-trio COMMAND --help shows a command's options.""",
})
_ENCODER: Mapping[str, Any] = MappingProxyType({
    "description": ("Serve the encoder: requests come over HTTP (protocol v1, SGLang's encoder API "
                    "with --api sglang, vLLM's with --api vllm) and, with --grpc-port, gRPC; "
                    "embeddings leave inline, over ZMQ, through Mooncake or to vLLM's EC connector. "
                    "SIGINT or SIGTERM lets in-flight requests finish (--drain-timeout), then exits 0.\n\n"
                    "Every option is also an EPD_* environment "
                    "variable (--max-batch-size: EPD_MAX_BATCH_SIZE); a flag wins over its variable. "
                    "A SIZE is bytes, or a number with a unit: 512KiB, 128MiB, 1GiB."),
    "epilog": """examples:
  # the embedded tiny random-weight model on 127.0.0.1:8000
  epd-trio encoder
  # a checkpoint on a GPU, reachable from other hosts, registered with a registry
  epd-trio encoder --model-path /models/Qwen2.5-VL-7B-Instruct --device cuda \\
      --host 0.0.0.0 --register-url http://registry:8997
  # a drop-in for SGLang's encoder-only server
  epd-trio encoder --api sglang --encoder-transfer-backend zmq_to_scheduler \\
      --host 0.0.0.0 --port 30002 --model-path /models/Qwen2.5-VL-7B-Instruct
  # an encoder instance of vLLM's EPD: embeddings go where vLLM's EC connector reads them
  epd-trio encoder --api vllm --port 8001 --model-path /models/Qwen2.5-VL-7B-Instruct \\
      --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}'
  # the delivery options, or every option
  epd-trio encoder --help=delivery
  epd-trio encoder --help=all""",
})
_BOOTSTRAP: Mapping[str, Any] = MappingProxyType({
    "description": ("Serve the bootstrap registry: encoders register with it (epd-trio encoder "
                    "--register-url) and clients discover the healthy ones through it "
                    "(ClientConfig.bootstrap_url). It probes every encoder's /health each "
                    "--health-interval and evicts one after --max-failures missed probes. SIGINT "
                    "or SIGTERM exits 0.\n\nEvery option is also an EPD_* environment variable "
                    "(--port: EPD_PORT); a flag wins over its variable."),
    "epilog": """examples:
  # a registry other hosts reach; registrations must carry the token
  EPD_AUTH_TOKEN=s3cret epd-trio bootstrap --host 0.0.0.0 --port 8997
  # an encoder that registers with it
  EPD_REGISTRY_AUTH_TOKEN=s3cret epd-trio encoder --register-url http://registry:8997""",
})
_PROXY: Mapping[str, Any] = MappingProxyType({
    "description": ("Serve the EPD proxy in front of vLLM: OpenAI requests (chat completions, "
                    "streamed or not, and completions) come in; a chat request's images, videos "
                    "and audio go first to encoder instances (epd-trio encoder --api vllm, or "
                    "vLLM's own), which store them where vLLM's EC connector reads them; then the "
                    "request goes on, unchanged, to a healthy prefill/decode vLLM server, and its "
                    "answer comes back as it arrives. SIGINT or SIGTERM exits 0.\n\nEvery option "
                    "is also an EPD_* environment variable (--port: EPD_PORT); a flag wins over "
                    "its variable."),
    "epilog": """examples:
  # two encoders and one vLLM server behind the proxy on 127.0.0.1:8000
  epd-trio proxy --encoder-urls http://127.0.0.1:8001,http://127.0.0.1:8002 \\
      --prefill-decode-urls http://127.0.0.1:8100
  # encoders discovered in a registry, two language servers, reachable from other hosts
  epd-trio proxy --host 0.0.0.0 --bootstrap-url http://registry:8997 \\
      --prefill-decode-urls http://vllm-a:8100,http://vllm-b:8100""",
})
_DEMO: Mapping[str, Any] = MappingProxyType({
    "description": ("Start a bootstrap registry and --encoders encoders in one program, encode five "
                    "sample images split across them through a client that discovers them in the "
                    "registry, check the stitched result against a local encode, and print a "
                    "table. The model is the embedded tiny random-weight one unless --model-path "
                    "names a checkpoint; the engine's options (--help=all) apply to every encoder."),
    "epilog": """examples:
  epd-trio demo
  # four encoders, embeddings written through Mooncake (needs the mooncake extra)
  epd-trio demo --encoders 4 --transfer-backend mooncake
  # a checkpoint on a GPU
  epd-trio demo --model-path /models/Qwen2.5-VL-3B-Instruct --device cuda""",
})
_TINY: Mapping[str, Any] = MappingProxyType({
    "description": ("Write a tiny checkpoint of a real architecture with random weights, in the "
                    "layout of a Hugging Face download (config.json, safetensors, the processors' "
                    "configs), for tests and trials without a download: its embeddings mean "
                    "nothing, but every code path runs for real."),
    "epilog": """examples:
  epd-trio make-tiny-model /tmp/tiny-qwen2_5_vl
  epd-trio make-tiny-model /tmp/tiny-qwen2_audio --arch qwen2_audio --seed 7
  epd-trio encoder --model-path /tmp/tiny-qwen2_5_vl""",
})


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="epd-trio", **_MAIN)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    encoder = sub.add_parser("encoder", help="serve the encoder", **_ENCODER,
                             brief=("model_path", "device", "host", "port", "api", "transfer_backend",
                                    "register_url", "log_level"))
    add_config_arguments(encoder, EncoderConfig)
    encoder.set_defaults(run=_encoder)

    bootstrap = sub.add_parser("bootstrap", help="serve the registry encoders register with and "
                               "clients discover them from", **_BOOTSTRAP,
                               brief=("host", "port", "auth_token", "log_level"))
    add_config_arguments(bootstrap, BootstrapConfig)
    bootstrap.set_defaults(run=_bootstrap)

    proxy = sub.add_parser("proxy", help="serve the EPD proxy in front of vLLM language servers",
                           **_PROXY, brief=("host", "port", "encoder_urls", "bootstrap_url",
                                            "prefill_decode_urls", "log_level"))
    add_config_arguments(proxy, ProxyConfig)
    proxy.set_defaults(run=_proxy)

    demo = sub.add_parser("demo", help="a registry, encoders and a client in one program: encode, "
                          "check, print a table", **_DEMO,
                          brief=("encoders", "transfer_backend", "model_path", "device"))
    demo.add_argument("--encoders", type=_bounded(1, 16), default=2, metavar="N",
                      help="how many encoders to start, 1-16 [default: 2]")
    demo.add_argument("--transfer-backend", choices=ENCODER_BACKENDS, default="zmq",
                      help="how embeddings travel (mooncake needs the mooncake extra) [default: zmq]")
    add_config_arguments(demo, EngineConfig)
    demo.set_defaults(run=_demo)

    _add_make_tiny_model(sub)
    return parser


def _add_make_tiny_model(sub: Any) -> None:
    from epd_trio.model.tiny import TINY_ARCHES

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint", **_TINY)
    tiny.add_argument("directory", help="where to write it: a new or empty directory, or one "
                      "holding a tiny model (written over); one with other files is refused")
    tiny.add_argument("--arch", choices=TINY_ARCHES, default="qwen2_5_vl",
                      help="the architecture: qwen2_5_vl (Qwen2.5-VL), qwen2_vl (Qwen2-VL), "
                      "qwen3_vl (Qwen3-VL) or qwen2_audio (Qwen2-Audio) [default: qwen2_5_vl]")
    tiny.add_argument("--seed", type=_bounded(0, 2**63 - 1), default=0, metavar="N",
                      help="seed of the random weights: one seed, one set of weights [default: 0]")
    tiny.set_defaults(run=_make_tiny_model)


def _bounded(low: int, high: int) -> Callable[[str], int]:
    def value(raw: str) -> int:
        try:
            number = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected int, got {raw!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {number}")
        return number

    return value


def configure_logging(level: str) -> None:
    """Our level for our lines; the chatty libraries' INFO lines only at debug.

    httpx logs every request at INFO (the demo's client, the registration
    heartbeats); the Mooncake engine logs through glog to stderr and reads
    ``MC_LOG_LEVEL`` when first imported: its INFO lines (ports, topology,
    "finish") only at our debug level. A ``MC_LOG_LEVEL`` you set wins.
    """
    check_log_level(level)
    debug = level.upper() == "DEBUG"
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if debug else "WARNING")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure_logging(getattr(args, "log_level", None) or os.environ.get("EPD_LOG_LEVEL", "INFO"))
        return int(args.run(args))
    except KeyboardInterrupt:
        return _interrupted()
    except (*_EXPECTED, BaseExceptionGroup) as exc:
        # Start-up errors may come wrapped by the nurseries they crossed: unwrap
        # only when every leaf is expected; a bug beside one keeps its traceback.
        found = list(leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in found):
            return _interrupted()
        if not all(isinstance(leaf, _EXPECTED) for leaf in found):
            raise
        for message in dict.fromkeys(str(leaf) for leaf in found):
            print(f"epd-trio: error: {message}", file=sys.stderr)
        return 2


def _interrupted() -> int:
    print("epd-trio: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
