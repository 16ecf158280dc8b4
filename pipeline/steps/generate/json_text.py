"""JSON for the generation step: fast, and precise about text that is not valid Unicode.

orjson, several times faster than the standard library: JSON is most of the
driver's own cost per row (benchmarks/README.md). The standard library takes over
only for what orjson refuses, to say exactly what is wrong: a lone surrogate escape
(``"\\ud800"``) is valid JSON, but the text it decodes to cannot be written as UTF-8,
sent to a server, or tokenized.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def utf8_json(value: Any) -> bytes:
    """``value`` as JSON in UTF-8; ``UnicodeEncodeError`` when a string in it is not valid Unicode."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        # A lone surrogate (the UnicodeEncodeError says where) or an integer beyond 64 bits.
        return json.dumps(value, ensure_ascii=False).encode("utf-8")


def loads(data: bytes | str) -> Any:
    """Parse JSON; a ``ValueError`` when it is not JSON.

    A lone surrogate escape (``"\\ud800"``) is valid JSON that orjson refuses: the
    standard library decodes it, so the caller can tell the row apart from garbage.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def not_unicode(exc: UnicodeEncodeError) -> str:
    """Where ``utf8_json`` failed, printable: the code points and the JSON text before them."""
    bad = ", ".join(f"U+{ord(c):04X}" for c in exc.object[exc.start : exc.end])
    before = exc.object[max(0, exc.start - 40) : exc.start]
    return f"lone surrogate {bad} after {ascii(before)}"
