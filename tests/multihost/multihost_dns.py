"""A DNS server for the multi-host tests: ``python multihost_dns.py ADDRESS ZONE_FILE``.

Answers A and AAAA queries over UDP on ``ADDRESS:53`` from ``ZONE_FILE``, JSON
``{"name": ["address", ...]}``, read again at every query so that the test can
change the records (a pod replaced, a Service emptied) while it runs; a name
not in it is NXDOMAIN. TTL 1 s: nothing caches it for long. Built on dnslib.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import time
from pathlib import Path
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class ZoneFile(BaseResolver):  # type: ignore[misc]
    def __init__(self, path: Path) -> None:
        self.path = path

    def resolve(self, request: Any, handler: Any) -> Any:
        zone = json.loads(self.path.read_text())
        name = str(request.q.qname).rstrip(".").lower()
        reply = request.reply()
        if name not in zone:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        wanted = QTYPE[request.q.qtype]
        for text in zone[name]:
            address = ipaddress.ip_address(text)
            if address.version == 4 and wanted in ("A", "ANY"):
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(text), ttl=1))
            elif address.version == 6 and wanted in ("AAAA", "ANY"):
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(text), ttl=1))
        return reply


def main(address: str, zone: str) -> None:
    quiet = DNSLogger(log="-request,-reply,-truncated,-recv,-send,-data", prefix=False)  # errors only
    server = DNSServer(ZoneFile(Path(zone)), address=address, port=53, logger=quiet)
    server.start_thread()
    print("EPD-DNS ready", flush=True)
    while server.isAlive():
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
