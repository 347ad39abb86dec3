"""The EPD proxy (``epd-trio proxy``): OpenAI requests in front of vLLM language servers,
their media stored by encoder instances first (see ``service``).

``async with serve_proxy(ProxyConfig(...)) as server:`` serves it on ``server.url``.
"""

from epd_trio.proxy.server import ProxyServer, serve_proxy

__all__ = ["ProxyServer", "serve_proxy"]
