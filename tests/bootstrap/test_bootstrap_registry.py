"""The registry's pure core: URL checks, per-encoder decisions, backoff — no trio, no clock."""

from __future__ import annotations

import pytest

from epd_trio.bootstrap.backoff import backoff_delay
from epd_trio.bootstrap.registry import (
    EncoderEntry,
    Registry,
    Transition,
    after_probe,
    is_expired,
    normalize_url,
)
from epd_trio.errors import OverloadedError, RequestError


@pytest.mark.parametrize(("raw", "normalized"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("HTTP://Encoder-1.Example.com:8000/", "http://encoder-1.example.com:8000"),
    ("https://enc_2.local:443/prefix/", "https://enc_2.local:443/prefix"),
    ("http://[::1]:9000", "http://[::1]:9000"),
    ("http://[0:0:0:0:0:0:0:1]:9000/", "http://[::1]:9000"),
])
def test_normalize_url_accepts_http_urls_with_host_and_port(raw: str, normalized: str) -> None:
    assert normalize_url(raw) == normalized


@pytest.mark.parametrize(("raw", "message"), [
    (None, "non-empty string"),
    ("", "non-empty string"),
    (8000, "non-empty string"),
    ("ftp://host:21", "http:// or https://"),
    ("host:8000", "http:// or https://"),
    ("//host:8000", "http:// or https://"),
    ("http://host", "must name a port"),
    ("http://host:0", "must name a port"),
    ("http://host:99999", "invalid port"),
    ("http://host:80x", "invalid port"),
    ("http://:8000", "must name a host"),
    ("http://bad host:8000", "whitespace"),
    ("http://host:8000\n", "whitespace"),
    ("http://ho$t:8000", "invalid host"),
    ("http://" + "a" * 64 + ":8000", "invalid host"),  # a DNS label is at most 63
    ("http://a..b:8000", "invalid host"),  # an empty label
    ("http://e1:8000/.", "path segments"),  # the same server as http://e1:8000
    ("http://e1:8000/a/../b", "path segments"),
    ("http://e1:8000/%2E%2e/x", "path segments"),
    ("http://" + ".".join(["a" * 63] * 4) + ":8000", "invalid host"),  # a name is at most 253
    ("http://[::zz]:8000", "not a valid URL|invalid IPv6"),
    ("http://user:pw@host:8000", "credentials"),
    ("http://host:8000/?a=1", "query or fragment"),
    ("http://host:8000#frag", "query or fragment"),
    ("http://host:8000/" + "a" * 3000, "longer than"),
])
def test_normalize_url_refuses_what_is_not_an_encoder_url(raw: object, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        normalize_url(raw)
    assert info.value.status_code == 400


@pytest.mark.parametrize(("raw", "normalized"), [
    ("http://Enc0/", "http://enc0"),  # kept without a port, not guessed
    ("GRPC://[0:0:0:0:0:0:0:1]", "grpc://[::1]"),
    ("https://e:443/p/", "https://e:443/p"),
])
def test_a_port_may_be_left_off_when_not_required(raw: str, normalized: str) -> None:
    assert normalize_url(raw, schemes=("http", "https", "grpc"), require_port=False) == normalized


def test_port_zero_is_refused_even_when_a_port_is_optional() -> None:
    with pytest.raises(RequestError, match="must name a port"):
        normalize_url("http://host:0", require_port=False)


def test_after_probe_evicts_at_the_max_failures_th_consecutive_miss() -> None:
    e = EncoderEntry("http://a:1", registered_at=0.0)
    e = after_probe(e, False, 10.0, 3)
    e = after_probe(e, False, 20.0, 3)
    assert (e.healthy, e.failures, e.evicted_at) == (True, 2, None)
    e = after_probe(e, True, 25.0, 3)  # an answer resets the count: misses must be consecutive
    assert (e.healthy, e.failures, e.last_ok) == (True, 0, 25.0)
    for now in (30.0, 40.0):
        e = after_probe(e, False, now, 3)
    assert e.healthy
    evicted = after_probe(e, False, 50.0, 3)
    assert (evicted.healthy, evicted.failures, evicted.evicted_at) == (False, 3, 50.0)
    still = after_probe(evicted, False, 60.0, 3)  # evicted stays evicted, since its eviction time
    assert (still.healthy, still.failures, still.evicted_at) == (False, 4, 50.0)
    revived = after_probe(still, True, 70.0, 3)
    assert (revived.healthy, revived.failures, revived.evicted_at, revived.last_ok) == (True, 0, None, 70.0)


def test_is_expired_at_exactly_evicted_ttl() -> None:
    e = EncoderEntry("http://a:1", registered_at=0.0, healthy=False, failures=3, evicted_at=100.0)
    assert not is_expired(e, 699.999, 600.0)
    assert is_expired(e, 700.0, 600.0)
    assert not is_expired(EncoderEntry("http://a:1", registered_at=0.0), 1e9, 600.0)


def test_registry_register_unregister_probe_expire_and_statistics() -> None:
    reg = Registry(max_failures=2, evicted_ttl=100.0)
    assert reg.register("http://a:1", 0.0) and reg.register("http://b:1", 1.0)
    assert not reg.register("http://a:1", 2.0)  # duplicates are ignored, time not reset
    assert reg.get("http://a:1").registered_at == 0.0  # type: ignore[union-attr]
    assert reg.healthy_urls() == ["http://a:1", "http://b:1"]
    assert reg.record_probe("http://a:1", False, 10.0) is Transition.UNCHANGED
    assert reg.record_probe("http://a:1", False, 20.0) is Transition.EVICTED
    assert reg.healthy_urls() == ["http://b:1"] and reg.urls() == ["http://a:1", "http://b:1"]
    assert reg.record_probe("http://gone:1", True, 20.0) is None
    assert reg.expire(119.0) == [] and reg.expire(120.0) == ["http://a:1"]
    assert reg.unregister("http://b:1") and not reg.unregister("http://b:1")
    s = reg.statistics()
    assert (s.encoders, s.healthy, s.evicted, s.registrations, s.unregistrations) == (0, 0, 0, 2, 1)
    assert (s.probes, s.probe_failures, s.evictions, s.revivals, s.forgotten) == (2, 2, 1, 0, 1)
    assert "0 encoders" in repr(reg)


def test_registry_revival_is_counted() -> None:
    reg = Registry(max_failures=1, evicted_ttl=100.0)
    reg.register("http://a:1", 0.0)
    assert reg.record_probe("http://a:1", False, 1.0) is Transition.EVICTED
    assert reg.record_probe("http://a:1", True, 2.0) is Transition.REVIVED
    assert reg.healthy_urls() == ["http://a:1"]
    assert (reg.statistics().evictions, reg.statistics().revivals) == (1, 1)


@pytest.mark.parametrize(("attempt", "delay"), [(0, 0.5), (1, 1.0), (2, 2.0), (5, 16.0), (6, 30.0),
                                                 (7, 30.0), (5000, 30.0)])
def test_backoff_is_capped_exponential_and_never_overflows(attempt: int, delay: float) -> None:
    assert backoff_delay(attempt, 0.5, 30.0) == delay


def test_registrations_stop_at_max_encoders() -> None:
    registry = Registry(max_failures=3, evicted_ttl=600.0, max_encoders=2)
    assert registry.register("http://a:1", 0.0) and registry.register("http://b:1", 0.0)
    assert registry.register("http://a:1", 1.0) is False  # a known one is no new entry
    with pytest.raises(OverloadedError, match="maximum of 2 encoders") as info:
        registry.register("http://c:1", 1.0)
    assert info.value.status_code == 503 and registry.urls() == ["http://a:1", "http://b:1"]
    registry.unregister("http://a:1")
    assert registry.register("http://c:1", 2.0)  # room again
