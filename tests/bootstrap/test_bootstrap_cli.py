"""`epd-trio bootstrap` and `epd-trio encoder --register-url` as an operator runs them."""

from __future__ import annotations

import signal

import httpx
import pytest
import trio

from conftest import listening_url, spawn
from epd_trio.cli import build_parser, main
from epd_trio.config import BootstrapConfig, EncoderConfig, config_from_args


async def listed(http: httpx.AsyncClient) -> list[str]:
    return (await http.get("/list_encoder_urls")).json()["encoder_urls"]


async def test_sigkilled_encoder_drops_out_and_registry_exits_cleanly(qwen25_path: str) -> None:
    interval, timeout, max_failures = 0.3, 0.5, 3
    with spawn("bootstrap", "--port", "0", "--health-interval", str(interval),
               "--health-timeout", str(timeout), "--max-failures", str(max_failures)) as registry:
        registry_url = await listening_url(registry)
        with spawn("encoder", "--port", "0", "--model-path", qwen25_path,
                   "--register-url", registry_url, "--heartbeat-interval", "0.5") as encoder:
            encoder_url = await listening_url(encoder)
            async with httpx.AsyncClient(base_url=registry_url, timeout=10) as http:
                with trio.fail_after(30):
                    while await listed(http) != [encoder_url]:
                        await trio.sleep(0.02)
                encoder.kill()  # SIGKILL: no goodbye; only the health loop can notice
                killed_at = trio.current_time()
                with trio.fail_after(10):
                    while await listed(http) != []:
                        await trio.sleep(0.02)
                took = trio.current_time() - killed_at
                (entry,) = (await http.get("/encoders")).json()["encoders"]
        bound = (max_failures + 1) * interval + timeout
        assert took <= bound, f"dropped out after {took:.2f} s, bound {bound:.2f} s"
        assert entry["url"] == encoder_url and not entry["healthy"]
        assert entry["failures"] >= max_failures and entry["evicted_at"] is not None
        registry.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: registry.wait(timeout=30))
        assert code == 0, registry.stderr.read()  # type: ignore[union-attr]


def test_flags_and_variables_reach_the_configs() -> None:
    parser = build_parser()
    args = parser.parse_args(["bootstrap", "--port", "0", "--max-failures", "5"])
    config = config_from_args(BootstrapConfig, args, {"EPD_HEALTH_INTERVAL": "0.5",
                                                      "EPD_AUTH_TOKEN": "tok"})
    assert (config.port, config.max_failures, config.health_interval, config.auth_token) == (
        0, 5, 0.5, "tok")
    assert (config.health_timeout, config.evicted_ttl) == (2.0, 600.0)
    args = parser.parse_args(["encoder", "--register-url", "http://r1:8997",
                              "--register-url", "HTTP://R2:8997/", "--heartbeat-interval", "5"])
    enc = config_from_args(EncoderConfig, args, {"EPD_ADVERTISE_URL": "http://me.example:8000"})
    assert enc.register_url == ("http://r1:8997", "http://r2:8997")
    assert (enc.advertise_url, enc.heartbeat_interval) == ("http://me.example:8000", 5.0)
    enc = config_from_args(EncoderConfig, parser.parse_args(["encoder"]),
                           {"EPD_REGISTER_URL": "http://r1:8997, http://r2:8997"})
    assert enc.register_url == ("http://r1:8997", "http://r2:8997")


def test_bad_flags_are_clean_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["bootstrap", "--max-failures", "0"], "max_failures (--max-failures) must be at least 1"),
                          (["bootstrap", "--health-interval", "-1"], "health_interval (--health-interval) must be > 0"),
                          (["encoder", "--register-url", "ftp://r:1"], "http:// or https://"),
                          (["encoder", "--advertise-url", "http://me"], "must name a port")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="auth_token must be non-empty"):
        BootstrapConfig(auth_token="")
