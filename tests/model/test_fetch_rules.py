"""The fetch rules at the check function: every rule, IPv4 and IPv6, literals and names.

Names resolve through the injected resolver (``FakeDNS``), never real DNS.
"""

from __future__ import annotations

import re

import httpx
import pytest

from epd_trio.errors import FetchRefusedError, RequestError
from epd_trio.model.fetch_rules import FetchRules, pin
from media_server import FakeDNS

DNS = {
    "metadata.test": ["169.254.169.254"],
    "aws6.test": ["fd00:ec2::254"],
    "link.test": ["169.254.7.7"],
    "mixed.test": ["93.184.216.34", "100.100.100.200"],  # one bad answer refuses the name
    "loop.test": ["127.0.0.1"],
    "private.test": ["10.1.2.3", "fd12:3456::1"],
    "public.test": ["93.184.216.34", "2606:2800:220:1::1"],
}
META = "a cloud metadata address (refused always)"
LINK = "link-local (refused always)"
PRIVATE = "(refused by --fetch-deny-private)"

# (url, refusal by default or None, refusal with deny_private or None)
CASES = [
    ("http://169.254.169.254/latest/meta-data/", f"169.254.169.254 is {META}", "same"),
    ("http://169.254.169.254./latest", f"169.254.169.254 is {META}", "same"),
    ("http://[fd00:ec2::254]/", f"fd00:ec2::254 is {META}", "same"),
    ("http://100.100.100.200/", f"100.100.100.200 is {META}", "same"),
    ("http://[::ffff:169.254.169.254]/", f"::ffff:a9fe:a9fe is {META}", "same"),
    ("http://[64:ff9b::a9fe:a9fe]/", f"64:ff9b::a9fe:a9fe is {META}", "same"),
    ("http://169.254.1.2/", f"169.254.1.2 is {LINK}", "same"),
    ("http://[fe80::1]/", f"fe80::1 is {LINK}", "same"),
    ("http://metadata.test/", f"host 'metadata.test' resolves to {META}", "same"),
    ("http://aws6.test/", f"host 'aws6.test' resolves to {META}", "same"),
    ("http://link.test/", f"host 'link.test' resolves to {LINK}", "same"),
    ("http://mixed.test/", f"host 'mixed.test' resolves to {META}", "same"),
    ("http://127.0.0.1:8000/", None, f"127.0.0.1 is loopback {PRIVATE}"),
    ("http://[::1]/", None, f"::1 is loopback {PRIVATE}"),
    ("http://0.0.0.0/", None, f"0.0.0.0 is loopback {PRIVATE}"),
    ("http://[::ffff:127.0.0.1]/", None, f"::ffff:7f00:1 is loopback {PRIVATE}"),
    ("http://10.1.2.3/", None, f"10.1.2.3 is private {PRIVATE}"),
    ("http://192.168.0.9/", None, f"192.168.0.9 is private {PRIVATE}"),
    ("http://[fd12:3456::1]/", None, f"fd12:3456::1 is private {PRIVATE}"),
    ("http://100.64.0.1/", None, f"100.64.0.1 is not globally routable {PRIVATE}"),
    ("http://loop.test/", None, f"host 'loop.test' resolves to loopback {PRIVATE}"),
    ("http://private.test/", None, f"host 'private.test' resolves to private {PRIVATE}"),
    ("http://93.184.216.34/", None, None),
    ("http://public.test/", None, None),
]


@pytest.mark.parametrize(("url", "default", "denied"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("deny_private", [False, True])
async def test_address_rules(url: str, default: str | None, denied: str | None, deny_private: bool) -> None:
    expected = (default if denied == "same" else denied) if deny_private else default
    dns = FakeDNS(DNS)
    if expected is None:
        hop = await pin(httpx.URL(url), FetchRules(deny_private=deny_private), dns)
        assert hop.url.host in {httpx.URL(url).host, *DNS.get(httpx.URL(url).host, [])}
    else:
        with pytest.raises(FetchRefusedError, match="is refused: " + re.escape(expected)) as info:
            await pin(httpx.URL(url), FetchRules(deny_private=deny_private), dns)
        assert info.value.status_code == 400


async def test_a_name_is_pinned_to_its_checked_address() -> None:
    dns = FakeDNS(DNS)
    hop = await pin(httpx.URL("https://public.test:8443/a.png?x=1"), FetchRules(), dns)
    assert str(hop.url) == "https://93.184.216.34:8443/a.png?x=1"  # the first answer
    assert hop.headers == {"Host": "public.test:8443", "Connection": "close"}
    assert hop.extensions == {"sni_hostname": "public.test"}  # TLS still verifies the name
    plain = await pin(httpx.URL("http://public.test/a.png"), FetchRules(), dns)
    assert (str(plain.url), plain.headers, plain.extensions) == (
        "http://93.184.216.34/a.png", {"Host": "public.test"}, {})
    literal = await pin(httpx.URL("http://93.184.216.34/a.png"), FetchRules(), dns)
    assert (str(literal.url), literal.headers) == ("http://93.184.216.34/a.png", {})
    assert dns.asked == ["public.test", "public.test"]  # literals are never looked up


async def test_the_allow_list_narrows_and_the_address_rules_still_apply() -> None:
    dns = FakeDNS({**DNS, "cdn.ok.test": ["93.184.216.34"], "meta.ok.test": ["169.254.169.254"],
                   "inside.ok.test": ["10.0.0.5"]})
    rules = FetchRules(allow_hosts=("ok.test",), deny_private=True)
    assert (await pin(httpx.URL("http://cdn.ok.test/a"), rules, dns)).url.host == "93.184.216.34"
    with pytest.raises(FetchRefusedError, match=f"host 'meta.ok.test' resolves to {re.escape(META)}"):
        await pin(httpx.URL("http://meta.ok.test/a"), rules, dns)
    with pytest.raises(FetchRefusedError, match=f"host 'inside.ok.test' resolves to private {re.escape(PRIVATE)}"):
        await pin(httpx.URL("http://inside.ok.test/a"), rules, dns)
    for url in ("http://public.test/a", "http://ok.test.evil/a", "http://93.184.216.34/a"):
        with pytest.raises(FetchRefusedError, match="is not in the encoder's fetch allow-list"):
            await pin(httpx.URL(url), rules, dns)
    assert dns.asked == ["cdn.ok.test", "meta.ok.test", "inside.ok.test"]  # refused names: no lookup


async def test_names_that_do_not_resolve() -> None:
    async def empty(host: bytes, port: int) -> list[str]:
        return []

    async def garbage(host: bytes, port: int) -> list[str]:
        return ["not-an-address"]

    with pytest.raises(RequestError, match=r"cannot resolve host 'nowhere.test' \(gaierror\)"):
        await pin(httpx.URL("http://nowhere.test/"), FetchRules(), FakeDNS({}))
    with pytest.raises(RequestError, match=r"cannot resolve host 'a.test' \(no address\)"):
        await pin(httpx.URL("http://a.test/"), FetchRules(), empty)
    with pytest.raises(RequestError, match=r"cannot resolve host 'a.test' \(ValueError\)"):
        await pin(httpx.URL("http://a.test/"), FetchRules(), garbage)
