"""Text views a detector inspects: normalised text, hidden text, and decoded encoded payloads.

Pure functions, no I/O. Attack text hides in several media; each helper here turns one medium into
plain text so that the same language rules can read it:

    raw bytes --decode--> str --NFKC, strip invisibles, fold confusables--> normalised text
                           |--> hidden: HTML comments, display:none spans, Unicode tag characters
                           '--> encoded: base64 / hex runs that decode to text, runs of numeric HTML
                                character references or %-escapes, the rot13 view
"""

from __future__ import annotations

import base64
import binascii
import codecs
import html
import itertools
import re
import string
import unicodedata
import urllib.parse

import numpy as np

from fleet.core.quarantine.prefilter import Alternation

# Zero-width and formatting characters with no visible glyph. ZWJ/ZWNJ are legitimate inside emoji
# sequences and Indic/Arabic words, so they count only between ASCII characters.
_ALWAYS_INVISIBLE = "\u200b\u2060\u2061\u2062\u2063\u2064\u180e\u00ad\ufeff"
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f"
_JOINERS = "\u200c\u200d"
_INVISIBLE_RE = re.compile(f"[{_ALWAYS_INVISIBLE}{_BIDI}{_JOINERS}]|[\U000e0000-\U000e007f]")
_STRICT_INVISIBLE_RE = re.compile(f"[{_ALWAYS_INVISIBLE}{_BIDI}\U000e0000-\U000e007f]")
# Runs of spaces to collapse: every run but a lone " " (which would be replaced by itself).
_SPACES_RE = re.compile(r"[ \t\r\f\v]{2,}|[\t\r\f\v]")
_TAG_RE = re.compile("[\U000e0020-\U000e007e]+")
_ASCII_JOINER_RE = re.compile(f"(?<=[\\x21-\\x7e])[{_JOINERS}](?=[\\x21-\\x7e])")

_HTML_COMMENT_RE = re.compile(r"<!--(.*?)-->", re.S)
_HIDDEN_STYLE_RE = re.compile(
    r"<(\w+)[^>]*style\s*=\s*[\"'][^\"']*(?:display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*0"
    r"|opacity\s*:\s*0(?:\.0+)?\s*(?:;|[\"'])|color\s*:\s*(?:white|#fff(?:fff)?\b|transparent))[^\"']*[\"'][^>]*>(.*?)</\1>",
    re.S | re.I,
)
_HIDDEN_ATTR_RE = re.compile(r"<(\w+)[^>]*\s(?:hidden|aria-hidden\s*=\s*[\"']true[\"'])[^>]*>(.*?)</\1>", re.S | re.I)

_B64_RE = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/_-]{24,}={0,2}(?![A-Za-z0-9+/=_-])")
_HEX_RE = re.compile(r"(?<![0-9A-Fa-f])(?:[0-9A-Fa-f]{2}[\s:]?){16,}(?![0-9A-Fa-f])")
# NOTE: a model reads `&#105;gnore` and `%69gnore` as "ignore"; the rules read the escapes. A text with 4+ numeric
# character references, or 6+ %-escapes, of ASCII letters is also read decoded, whole (escaped_views). Letters:
# benign text escapes what needs escaping (spaces, slashes, symbols, non-ASCII), and never needs to escape a letter
_NUMREF_RE = re.compile(r"&#(?:([0-9]{1,7})|[xX]([0-9a-fA-F]{1,6}));?")
_PERCENT_RE = re.compile(r"%([0-9A-Fa-f]{2})")

# Latin look-alikes from Cyrillic and Greek, folded only inside words that mix scripts.
_CONFUSABLES_SRC = {
    "а": "a", "е": "e", "о": "o", "р": "p", "с": "c", "х": "x", "у": "y", "і": "i", "ѕ": "s", "ј": "j",
    "к": "k", "м": "m", "т": "t", "н": "h", "в": "b", "ԁ": "d", "ɡ": "g",
    "α": "a", "ε": "e", "ο": "o", "ρ": "p", "ι": "i", "κ": "k", "ν": "v", "τ": "t", "υ": "u", "χ": "x",
}
_CONFUSABLES = str.maketrans(_CONFUSABLES_SRC)
_CONFUSABLE_CHAR_RE = re.compile("[" + "".join(_CONFUSABLES_SRC) + "]")
_WORD_RE = re.compile(r"\w+")
_ROT13_WORDS = Alternation.of(r"\b(?:gur|naq|lbh|lbhe|nyy|bs|gb|vf|vg|sbe|abj|guvf|jvgu|vafgehpgvbaf|cebzcg|flfgrz|cerivbhf)\b")


def decode_bytes(data: str | bytes | bytearray | memoryview) -> str:
    """Bytes -> str (UTF-8, or UTF-16 with a BOM); undecodable bytes become U+FFFD."""
    if isinstance(data, str):
        return data
    raw = bytes(data)
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return raw.decode("utf-16", errors="replace")
    return raw.decode("utf-8", errors="replace")


def count_invisible(text: str) -> int:
    """Invisible characters that have no business in a tool result (ASCII-context joiners included)."""
    if text.isascii():  # NOTE: every invisible character is non-ASCII; the common case costs no regex pass
        return 0
    lead_bom = 1 if text.startswith("\ufeff") else 0
    return len(_STRICT_INVISIBLE_RE.findall(text)) - lead_bom + len(_ASCII_JOINER_RE.findall(text))


def _fold_word(m: re.Match[str]) -> str:
    w = m.group(0)
    has_latin = any("a" <= c <= "z" for c in w)
    has_other = any(c.translate(_CONFUSABLES) != c for c in w)
    return w.translate(_CONFUSABLES) if has_latin and has_other else w


def mixed_script_words(text: str) -> int:
    """How many words mix Latin letters with Cyrillic/Greek look-alikes (a homoglyph trick)."""
    t = text.casefold()
    if _CONFUSABLE_CHAR_RE.search(t) is None:  # NOTE: keeps pure-ASCII text (the common case) linear and cheap
        return 0
    return sum(1 for m in _WORD_RE.finditer(t) if _fold_word(m) != m.group(0))


NORMALIZE_CHUNK = 1 << 16  # characters normalised at once by `normalize` (cut only before a newline)


def normalize(text: str) -> str:
    r"""NFKC, drop invisibles, casefold, fold confusables inside mixed-script words, collapse spaces.

    NOTE: a long text is normalised in pieces of about NORMALIZE_CHUNK characters, each cut just before a "\n"
    (issue #28: NFKC of a 1 MiB text that is not ASCII builds a 4-byte-per-character copy; the pieces keep
    that to one piece). The pieces give the same text as one pass: "\n" composes with nothing on either side
    and starts no reordering (NFKC), the invisibles and casefolding go character by character, a word (\w+)
    and a run of spaces to collapse ([ \t\r\f\v]) never hold a "\n", and no character normalises to one.
    A text without newlines is one piece. (A short text is normalised here, without a call to the piecewise
    path: one more Python frame on this path cost 0.5-1 ms of CPU per 4 KiB result, in the frame-stack chunk
    maps and unmaps docs/quarantine_default.md describes.)
    """
    if len(text) > NORMALIZE_CHUNK and text.find("\n", NORMALIZE_CHUNK) >= 0:
        return _normalize_pieces(text)  # NOTE: each piece holds no "\n" past NORMALIZE_CHUNK: one pass each
    if text.isascii():  # NOTE: NFKC, the invisibles and the confusables leave ASCII text as it is
        return _collapse_spaces(text.casefold())
    t = _INVISIBLE_RE.sub("", unicodedata.normalize("NFKC", text)).casefold()
    if _CONFUSABLE_CHAR_RE.search(t) is not None:
        t = _WORD_RE.sub(_fold_word, t)
    return _collapse_spaces(t)


def _normalize_pieces(text: str) -> str:
    parts, lo = [], 0
    while lo < len(text):
        cut = text.find("\n", lo + NORMALIZE_CHUNK)
        hi = len(text) if cut < 0 else cut
        parts.append(normalize(text[lo:hi]))
        lo = hi
    return "".join(parts)


def _collapse_spaces(t: str) -> str:
    # NOTE: without tabs, CR, FF, VT or two spaces in a row there is nothing to collapse: a text normalised once
    # (the learned layer's view) skips the regex pass
    if "  " in t or "\t" in t or "\r" in t or "\f" in t or "\v" in t:
        return _SPACES_RE.sub(" ", t)
    return t


def hidden_segments(text: str) -> list[str]:
    """Text a human reader would not see: HTML comments, hidden elements, Unicode tag characters."""
    out = [m.group(1) for m in _HTML_COMMENT_RE.finditer(text)]
    out += [m.group(2) for m in _HIDDEN_STYLE_RE.finditer(text)]
    out += [m.group(2) for m in _HIDDEN_ATTR_RE.finditer(text)]
    if not text.isascii():  # NOTE: tag characters are non-ASCII
        out += ["".join(chr(ord(c) - 0xE0000) for c in m.group(0)) for m in _TAG_RE.finditer(text)]
    return [s for s in out if s.strip()]


def _printable_text(raw: bytes, min_len: int = 12) -> str | None:
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ok = sum(1 for c in s if c.isprintable() or c in "\n\t\r")
    return s if len(s) >= min_len and ok >= 0.95 * len(s) and any(c.isalpha() for c in s) else None


def _ascii_table(chars: str) -> np.ndarray:
    """(129,) bool: which code points (those >= 128 read as 128) are in `chars`."""
    table = np.zeros(129, dtype=bool)
    table[[ord(c) for c in chars]] = True
    return table


_B64_CHARS = _ascii_table(string.ascii_letters + string.digits + "+/_-")
_HEX_CHARS = _ascii_table(string.hexdigits)


def code_points(text: str) -> np.ndarray:
    """(L,) the code points of `text`: uint8 when it is ASCII (a quarter of the memory), else uint32."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


DENSE_CHUNK = 1 << 16  # window starts scanned at once by `_dense`


def _dense(codes: np.ndarray, table: np.ndarray, width: int, count: int) -> bool:
    """Some `width` consecutive characters (or all, if fewer) hold `count` of the table's characters.

    NOTE: DENSE_CHUNK window starts at a time, each chunk read with the `width - 1` characters after it, so
    every window lies whole in one chunk: the same answer as the whole text at once, in about 9 bytes per
    character of one chunk instead of the whole text's (a 1 MiB result peaked 10 MB higher, issue #28).
    """
    n = len(codes)
    if n < count:
        return False
    w = min(width, n)
    for a in range(0, n - w + 1, DENSE_CHUNK):
        seg = codes[a : a + DENSE_CHUNK + w - 1]
        c = np.zeros(len(seg) + 1, dtype=np.int32)  # (chunk + w,)
        np.cumsum(table[seg if seg.dtype == np.uint8 else np.minimum(seg, 128)], out=c[1:])
        if (c[w:] - c[:-w]).max() >= count:
            return True
    return False


def decoded_payloads(text: str, limit: int = 64) -> list[tuple[str, str]]:
    """(encoding, decoded text) for base64 and hex runs that decode to readable text."""
    out: list[tuple[str, str]] = []
    # NOTE: a base64 run is 24+ characters of its alphabet in a row, a hex run 16+ digit pairs with at most one
    # separator between pairs (32 digits within 47 characters): a text with neither skips that regex's pass.
    codes = code_points(text)  # (L,)
    for m in _B64_RE.finditer(text) if _dense(codes, _B64_CHARS, 24, 24) else ():
        s = m.group(0)
        s_std = s.replace("-", "+").replace("_", "/")
        try:
            raw = base64.b64decode(s_std + "=" * (-len(s_std) % 4), validate=True)
        except (binascii.Error, ValueError):
            continue
        if (decoded := _printable_text(raw)) is not None:
            out.append(("base64", decoded))
        if len(out) >= limit:
            return out
    for m in _HEX_RE.finditer(text) if _dense(codes, _HEX_CHARS, 47, 32) else ():
        digits = re.sub(r"[\s:]", "", m.group(0))
        if len(digits) % 2 == 0 and (decoded := _printable_text(bytes.fromhex(digits))) is not None:
            out.append(("hex", decoded))
    return out[:limit]


def escaped_views(text: str) -> list[tuple[str, str]]:
    """(encoding, the whole text decoded) for numeric HTML character references ("html": 4 or more of ASCII
    letters) and %-escapes ("url": 6 or more of ASCII letters), where decoding changes the text. A text with no "&#" or "%" costs two
    substring checks.

    NOTE: decoded runs of escapes, at most 64, were read first: 64 harmless runs (a copyright sign repeated) used
    the budget up before an attack's, and a %-run could not cross a space, so escapes spread over the words of a
    sentence were never decoded (a review's bypasses). The whole text has neither limit."""
    out: list[tuple[str, str]] = []
    for kind, mark, escape_re, least, decode in (("html", "&#", _NUMREF_RE, 4, html.unescape),
                                                 ("url", "%", _PERCENT_RE, 6, urllib.parse.unquote)):
        if mark not in text:
            continue
        letters = (m for m in escape_re.finditer(text) if chr(_escaped_code(m)).isascii() and chr(_escaped_code(m)).isalpha())
        if len(list(itertools.islice(letters, least))) == least:
            decoded = decode(text)
            if decoded != text:
                out.append((kind, decoded))
    return out


def _escaped_code(m: re.Match[str]) -> int:
    """The code point one escape stands for (decimal or hex reference, or a %-escape's byte); 0 past Unicode."""
    dec, hexa = (m.group(1), m.group(2)) if m.re is _NUMREF_RE else (None, m.group(1))
    code = int(dec) if dec else int(hexa, 16)
    return code if code <= 0x10FFFF else 0


def looks_rot13(norm: str) -> bool:
    """Worth a rot13 view: the text names rot13, or carries several rot13'd common English words."""
    if "rot13" in norm or "rot-13" in norm:
        return True
    words = _ROT13_WORDS.finditer(norm[: 1 << 20])  # NOTE: the slice ends the string there, as an endpos did
    return len(list(itertools.islice(words, 2))) == 2


def rot13(text: str) -> str:
    return codecs.decode(text, "rot13")
