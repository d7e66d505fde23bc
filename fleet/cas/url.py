"""A store URL as it may be shown: without its credentials (logs, GetFleet, errors)."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlsplit

# query parameters of a store URL shown as they are; any other's value is redacted (redis-py reads
# `password` and `username` from the query too, with the names percent-decoded)
_SHOWN_PARAMS = frozenset({"db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
                           "max_connections", "health_check_interval", "ssl_cert_reqs", "ssl_check_hostname",
                           "protocol", "client_name", "decode_responses", "encoding", "timeout"})


def redact(url: str) -> str:
    """A store URL without its credentials, in every form redis-py's parser (`redis.connection.parse_url`)
    reads one: the whole user info (`user:password@`, up to the LAST '@' of the authority, as
    urlparse reads it: `redis://:p@ss@host` has password 'p@ss'), and the value of every query
    parameter not known to be harmless (`?password=`, `?username=`, `?pass%77ord=`)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a store URL that does not parse>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe='') if k in _SHOWN_PARAMS else '***'}"
                     for k, v in parse_qsl(parts.query, keep_blank_values=True))
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
