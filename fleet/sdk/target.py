"""The controller's address a client is given, checked before a channel is made.

NOTE: gRPC takes a port past 65535 modulo 2**16 (`127.0.0.1:99999` connected to port 34463, and the bearer token
went to whatever listened there), printed its C++ errors and answered UNKNOWN for an empty address, and retried an
address it could never parse (`not an address`, `[::1`) for 9 s before calling the controller unreachable (found
by review). Each is now InvalidArgument naming the address, before anything is sent.
"""

from __future__ import annotations

from fleet.core.errors import InvalidArgument

# gRPC's own target URIs (name resolvers) are passed as they are: gRPC parses them
SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:", "google-c2p:")
FORM = "give HOST:PORT (e.g. 127.0.0.1:50051, [::1]:50051) or a gRPC target URI (dns:///HOST:PORT, unix:PATH)"


def target(value: object) -> str:
    """`value` as the address of a controller: HOST:PORT, [IPv6]:PORT, HOST alone (gRPC's default port, 443) or a
    gRPC target URI.

    Raises:
        InvalidArgument: naming the address: not a str, empty, holding a space or a control character, a port that
            is not a number in 1..65535, or an IPv6 address outside brackets.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"the controller's address must be a str, got {type(value).__name__} {value!r:.40}")
    if not value or not value.isprintable() or any(ch.isspace() for ch in value):
        raise InvalidArgument(f"the controller's address {value!r} is not an address: {FORM}")
    if value.startswith(SCHEMES):
        return value
    scheme, sep, _ = value.partition("://")
    if sep and scheme.isascii() and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        # NOTE: a URL (a worker's http://..., https://, grpc://) was read as an IPv6 address outside brackets, or as
        # a port "//HOST" (review finding)
        raise InvalidArgument(f"the controller's address {value!r} is a URL ({scheme}://), not a controller address: "
                              f"{FORM}")
    host, port = _split(value)
    if not host:
        raise InvalidArgument(f"the controller's address {value!r} names no host: {FORM}")
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise InvalidArgument(f"the controller's address {value!r}: port {port!r} is not a number in 1..65535")
    return value


def _split(value: str) -> tuple[str, str | None]:
    """(host, port or None) of HOST[:PORT] or [IPv6][:PORT]."""
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1:] if end > 0 else "?"
        if rest and not rest.startswith(":"):
            raise InvalidArgument(f"the controller's address {value!r}: an IPv6 address is written [ADDR]:PORT")
        return value[1:end], rest[1:] if rest else None
    if value.count(":") > 1:
        raise InvalidArgument(f"the controller's address {value!r}: write an IPv6 address in brackets, "
                              "[ADDR]:PORT (e.g. [::1]:50051)")
    host, sep, port = value.partition(":")
    return host, port if sep else None
