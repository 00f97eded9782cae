"""Which hosts an image URL may reach: the replica's guard against server-side request forgery.

A client's image URL makes the replica open a connection, so by default it may only reach the
public internet: a host that resolves to a loopback, private (RFC 1918), CGNAT, link-local,
multicast, unspecified or IPv6 unique-local address is refused (`ImageError`, a 400 naming the
part). The host is resolved once, every address it resolves to is checked, and the fetch then
connects to that checked address (`PinnedURL`), so a DNS answer that changes between the check
and the connect (DNS rebinding) cannot move the fetch inside; each redirect hop is pinned again.
`images.allow_private_networks` turns the address check off; `images.allowed_hosts` limits
fetches to the listed host names either way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from deployments.frontend.images.limits import ImageError, ImageLimits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

NOT_PUBLIC = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",  # unspecified ("this host": 0.0.0.0 connects to loopback on Linux)
        "10.0.0.0/8",  # RFC 1918
        "100.64.0.0/10",  # CGNAT (shared address space: often a provider's internal network)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local (cloud metadata services live at 169.254.169.254)
        "172.16.0.0/12",  # RFC 1918
        "192.168.0.0/16",  # RFC 1918
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and 255.255.255.255 broadcast
        "::/128",  # unspecified
        "::1/128",  # loopback
        "fc00::/7",  # unique-local
        "fe80::/10",  # link-local
        "ff00::/8",  # multicast
    )
)
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # a NAT64 gateway forwards to the embedded IPv4


def is_public(ip: IPAddress) -> bool:
    """False for an address on a private or local network (also inside IPv4-mapped IPv6)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return not any(ip in net for net in NOT_PUBLIC if net.version == ip.version)


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to (a literal IP resolves to itself), in the system's
    order; on the event loop's executor, so a slow resolver never blocks the loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # NOTE: the scope of a link-local IPv6 (`fe80::1%eth0`) is dropped: such an address is
    # refused by default, and with the check off the URL is fetched as given (never pinned).
    return list(
        dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos)
    )


@dataclass(frozen=True)
class PinnedURL:
    """A URL to request with the host replaced by its checked address; `headers` and
    `extensions` keep the original host for the Host header and for TLS (SNI and certificate)."""

    url: httpx.URL
    headers: dict[str, str]
    extensions: dict[str, str]


@dataclass(frozen=True)
class HostGuard:
    """The address check and host list of `ImageLimits`; `resolver` and `public` are seams for
    tests (a fake DNS answer, a loopback address that counts as public)."""

    allow_private_networks: bool = False
    allowed_hosts: frozenset[str] | None = None
    resolver: Resolver = resolve
    public: Callable[[IPAddress], bool] = is_public

    @staticmethod
    def of(limits: ImageLimits) -> HostGuard:
        hosts = None if limits.allowed_hosts is None else frozenset(limits.allowed_hosts)
        return HostGuard(limits.allow_private_networks, hosts)

    async def pin(self, url: str) -> PinnedURL:
        """The URL to connect to for `url` (http or https), or ImageError."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ImageError(f"image URL is malformed: {exc}") from None
        host = parsed.raw_host.decode("ascii").lower()
        if not host:
            raise ImageError("image URL has no host")
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            if parsed.host.lower() not in self.allowed_hosts:  # listed in its unicode form
                raise ImageError(f"image URL's host {parsed.host!r} is not in allowed_hosts")
        if self.allow_private_networks:
            return PinnedURL(parsed, {}, {})
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise ImageError(f"image URL's host {parsed.host!r} cannot be resolved") from exc
        if not addresses or not all(self.public(ip) for ip in addresses):
            # NOTE: every address, not only the first: the connection could use any of them.
            raise ImageError(
                f"image URL's host {parsed.host!r} is on a private or local network "
                "(refused unless images.allow_private_networks is set)"
            )
        return _pinned(parsed, addresses[0])


def _pinned(parsed: httpx.URL, ip: IPAddress) -> PinnedURL:
    # Why rewrite the URL rather than resolve inside the transport: httpx has no public hook for
    # the address a connection opens, and a rewritten URL is checked and connected as one value.
    # The Host header keeps virtual hosting working; for https, `sni_hostname` makes httpcore
    # send the original name in SNI and verify the certificate against it, not against the IP.
    extensions = (
        {"sni_hostname": parsed.raw_host.decode("ascii")} if parsed.scheme == "https" else {}
    )
    return PinnedURL(
        parsed.copy_with(host=str(ip)), {"host": parsed.netloc.decode("ascii")}, extensions
    )
