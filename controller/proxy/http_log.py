"""The logger of the proxy's HTTP servers (aiohttp's RequestHandler `logger`): a request its HTTP parser refuses is one
line, not an error with a traceback.

aiohttp answers a request it cannot parse (a header line over 8,190 bytes, more than 128 headers, two Content-Lengths,
a bad chunk size, an invalid request target) with a plain-text 400 itself, before any handler runs, and logs it with
`logger.exception`: an ERROR and a 30-line traceback per request, which any client could send without a token, with
up to 100 bytes of the offending line (a too-long Authorization header's token among them) in the log. vLLM's server
(uvicorn) logs such a request as one warning, "Invalid HTTP request received.". Found by scripts/fuzz_proxy.py.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

HTTP_LOG = logging.getLogger("kvfleet.proxy.http")
MAX_REASON = 80  # characters of the parser's reason logged (its first line, without the bytes it quotes)


class _MalformedRequests(logging.Filter):
    """A record of a request aiohttp's parser refused becomes one WARNING line naming the client and the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno > logging.WARNING:  # (aiohttp's debug ones stay)
            reason = (exc.message or type(exc).__name__).strip().splitlines()[0].split(" b'")[0].rstrip(":")
            client = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "proxy: malformed HTTP request from %s, answered %d: %s (%s)"
            record.args = (client, exc.code or 400, reason[:MAX_REASON], type(exc).__name__)
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.exc_info, record.exc_text = None, None
        return True


HTTP_LOG.addFilter(_MalformedRequests())
