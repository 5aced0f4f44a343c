"""What every section of the configuration shares: strict, frozen models, and the address checks."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict

_HOST = r"(\[(?P<ipv6>[^\]\s]+)\]|[^/\s:\[\]]+)"  # a name, an IPv4 address or a bracketed IPv6 one
_HTTP_URL = re.compile(rf"^https?://{_HOST}(:(?P<port>\d{{1,5}}))?/?$")
_ZMQ_ENDPOINT = re.compile(rf"^(tcp://{_HOST}:(?P<port>\d{{1,5}})|ipc://\S+)$")


class Strict(BaseModel):
    # No setting means infinity: an .inf weight or timeout is a typo, and inf * 0 = nan breaks scoring.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def checked_http_url(url: str) -> str:
    match = _HTTP_URL.match(url)
    if not match:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] URL")
    _check_host_and_port(url, match)
    return url.rstrip("/")


def checked_zmq_endpoint(endpoint: str) -> str:
    match = _ZMQ_ENDPOINT.match(endpoint)
    if not match:
        raise ValueError(f"{endpoint!r} is not a ZMQ endpoint such as tcp://127.0.0.1:5557")
    _check_host_and_port(endpoint, match)
    return endpoint


def _check_host_and_port(address: str, match: re.Match[str]) -> None:
    if match["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(match["ipv6"])
        except ValueError:
            raise ValueError(f"{address!r}: [{match['ipv6']}] is not an IPv6 address") from None
    port = match["port"]
    if port is not None and not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: port {port} is not in 1-65535")
