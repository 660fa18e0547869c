"""Byte sizes as people write them: ``parse_bytes("1.5GiB")`` and ``format_bytes(1610612736)``."""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["parse_bytes", "format_bytes"]

# Decimal (SI) and binary (IEC) units; all of them count bytes. Lowercase keys: matching is
# case-insensitive because "512mb" and "512MB" are both common and mean bytes, never bits.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")
_EXAMPLE = "an int number of bytes or a string such as '512MiB', '2GB', '1.5GiB' or '4096'"


def parse_bytes(value) -> int:
    """Return the byte count given by ``value``: an int (``>= 0``) or a string ``<number><unit>``.

    Units are case-insensitive: ``B``, decimal ``KB MB GB TB PB`` (powers of 1000) and binary
    ``KiB MiB GiB TiB PiB`` (powers of 1024); no unit means bytes. The number may have a fraction
    (``"1.5GiB"``) or an exponent (``"1e9"``); a fractional byte count is rounded down. Bare
    prefixes such as ``"512M"`` are refused because they are ambiguous between 10**6 and 2**20.

    >>> parse_bytes("1.5GiB"), parse_bytes("2GB"), parse_bytes(4096)
    (1610612736, 2000000000, 4096)
    """
    if isinstance(value, bool):
        raise TypeError(f"memory size must be {_EXAMPLE} (got the bool {value!r})")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(f"memory size must be >= 0 bytes (got {value})")
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value) or value < 0 or not float(value).is_integer():
            raise ValueError(
                f"memory size must be a whole, non-negative number of bytes (got {value!r}); "
                f"give {_EXAMPLE}"
            )
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"memory size must be {_EXAMPLE} (got {type(value).__name__} {value!r})")
    m = _PATTERN.match(value)
    unit = m.group(3).lower() if m else None
    if m is None or unit not in _UNITS:
        hint = ""
        if unit is not None and unit in {"k", "m", "g", "t", "p"}:
            u = m.group(3).upper()
            hint = f" ('{m.group(3)}' is ambiguous: write '{u}B' or '{u}iB')"
        raise ValueError(f"cannot parse memory size {value!r}{hint}; expected {_EXAMPLE}")
    try:
        scaled = float(f"{m.group(1)}e{m.group(2) or 0}") * _UNITS[unit]
    except OverflowError:
        scaled = math.inf
    if not math.isfinite(scaled):
        raise ValueError(f"memory size {value!r} is too large to represent; expected {_EXAMPLE}")
    if m.group(2) is None and "." not in m.group(1):
        return int(m.group(1)) * _UNITS[unit]  # exact for big integers, no float rounding
    return int(math.floor(scaled))


def format_bytes(num: int) -> str:
    """``format_bytes(1610612736) == '1.50 GiB'``: binary units, for messages and tables."""
    num = int(num)
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                        ("KiB", 2**10)):
        if abs(num) >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num} B"
