"""The ``epd-trio`` command: one subcommand per thing an operator runs."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from epd_trio._util import first_leaf
from epd_trio.config import (
    BootstrapConfig,
    EncoderConfig,
    EngineConfig,
    add_config_arguments,
    config_from_args,
)
from epd_trio.errors import EPDError

__all__ = ["main"]


def _make_tiny_model(args: argparse.Namespace) -> int:
    from epd_trio.model.tiny import TinySpec, make_tiny_model

    path = make_tiny_model(args.directory, TinySpec(arch=args.arch, seed=args.seed))
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


async def _serve_until_signal(config: EncoderConfig | BootstrapConfig) -> None:
    """Serve until SIGINT/SIGTERM, then leave the block: a graceful shutdown, exit 0."""
    import signal

    from epd_trio.bootstrap.server import serve_bootstrap
    from epd_trio.encoder.server import serve_encoder

    what, serve = (("encoder", serve_encoder) if isinstance(config, EncoderConfig)
                   else ("bootstrap", serve_bootstrap))
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with serve(config) as server:  # type: ignore[operator]
            print(f"epd-trio {what} listening on {server.url}", flush=True)
            async for signum in signals:
                logging.getLogger(__name__).info("%s: shutting the %s down gracefully",
                                                 signal.Signals(signum).name, what)
                break


def _bootstrap(args: argparse.Namespace) -> int:
    config = config_from_args(BootstrapConfig, args)
    logging.getLogger().setLevel(config.log_level.upper())
    trio.run(_serve_until_signal, config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from epd_trio.model.tiny import TINY_ARCHES

    parser = argparse.ArgumentParser(prog="epd-trio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint")
    tiny.add_argument("directory")
    tiny.add_argument("--arch", choices=TINY_ARCHES, default="qwen2_5_vl")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny_model)

    encoder = sub.add_parser("encoder", help="serve the encoder over HTTP (SIGINT/SIGTERM drain, exit 0)")
    add_config_arguments(encoder, EncoderConfig)
    encoder.set_defaults(run=_encoder)

    bootstrap = sub.add_parser("bootstrap", help="serve the bootstrap registry encoders register with "
                               "and clients discover them from (SIGINT/SIGTERM exit 0)")
    add_config_arguments(bootstrap, BootstrapConfig)
    bootstrap.set_defaults(run=_bootstrap)

    demo = sub.add_parser("demo", help="two encoders and a client in one program: encode sample "
                          "images split across both, check, print a table")
    demo.add_argument("--encoders", type=int, default=2, help="how many encoders to start")
    demo.add_argument("--transfer-backend", choices=("zmq", "mooncake"), default="zmq",
                      help="how embeddings travel (mooncake needs the mooncake extra)")
    add_config_arguments(demo, EngineConfig)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", None) or os.environ.get("EPD_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The Mooncake engine logs through glog to stderr and reads this when first imported:
    # its INFO lines (ports, topology, "finish") only at our debug level. Yours wins.
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if level.upper() == "DEBUG" else "WARNING")
    try:
        return int(args.run(args))
    except (EPDError, ValueError, BaseExceptionGroup) as exc:
        # Start-up errors may come wrapped by the nurseries they crossed.
        leaf = first_leaf(exc)
        if not isinstance(leaf, (EPDError, ValueError)):
            raise
        print(f"epd-trio: error: {leaf}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
