"""Host names and bind addresses: the host part of a Host header or address, and whether an
address is loopback (the refusal to serve a non-loopback address without tokens,
`check_bind_safety`, is a rule over the settings and lives with them in `sections.py`)."""

from __future__ import annotations

import ipaddress
import re

_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(host: str) -> str:
    """The host of a Host header or an address without its port and IPv6 brackets, lower case."""
    host = host.lower()
    if host.startswith("["):
        inside, bracket, rest = host[1:].partition("]")
        return inside if bracket and (not rest or rest[1:].isdigit() and rest[0] == ":") else host
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:  # an unbracketed IPv6 address keeps its colons
        return name
    return host


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    """Whether a bind address is loopback: `localhost` or a loopback IP address, parsed
    (`127.attacker.example` is a name, not 127.0.0.0/8)."""
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
