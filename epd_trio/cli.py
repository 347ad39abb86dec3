"""The ``epd-trio`` command: one subcommand per thing an operator runs."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import trio

from epd_trio._util import leaves
from epd_trio.config import (
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


def build_parser() -> argparse.ArgumentParser:
    from epd_trio.model.tiny import TINY_ARCHES

    parser = _Parser(prog="epd-trio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint")
    tiny.add_argument("directory")
    tiny.add_argument("--arch", choices=TINY_ARCHES, default="qwen2_5_vl")
    tiny.add_argument("--seed", type=_bounded(0, 2**63 - 1), default=0)
    tiny.set_defaults(run=_make_tiny_model)

    encoder = sub.add_parser("encoder", help="serve the encoder over HTTP (SIGINT/SIGTERM drain, exit 0)")
    add_config_arguments(encoder, EncoderConfig)
    encoder.set_defaults(run=_encoder)

    bootstrap = sub.add_parser("bootstrap", help="serve the bootstrap registry encoders register with "
                               "and clients discover them from (SIGINT/SIGTERM exit 0)")
    add_config_arguments(bootstrap, BootstrapConfig)
    bootstrap.set_defaults(run=_bootstrap)

    proxy = sub.add_parser("proxy", help="serve the EPD proxy in front of vLLM: OpenAI requests' "
                           "media stored by encoders (--api vllm), then the request forwarded to a "
                           "prefill/decode server, streams relayed (SIGINT/SIGTERM exit 0)")
    add_config_arguments(proxy, ProxyConfig)
    proxy.set_defaults(run=_proxy)

    demo = sub.add_parser("demo", help="two encoders and a client in one program: encode sample "
                          "images split across both, check, print a table")
    demo.add_argument("--encoders", type=_bounded(1, 16), default=2, help="how many encoders to start (1-16)")
    demo.add_argument("--transfer-backend", choices=("zmq", "mooncake"), default="zmq",
                      help="how embeddings travel (mooncake needs the mooncake extra)")
    add_config_arguments(demo, EngineConfig)
    demo.set_defaults(run=_demo)
    return parser


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, as every other start-up error is (not the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
