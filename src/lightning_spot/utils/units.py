"""Small number helpers shared across the package: divisors and byte sizes.

divisors(12)              # [1, 2, 3, 4, 6, 12]
parse_bytes("80GB")       # 80e9
format_bytes(1.5 * 2**30) # "1.5 GiB"
"""

from __future__ import annotations

_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_bytes(value: float | str | None) -> float | None:
    """``"80GB"``, ``"512MiB"``, ``2e9`` -> bytes (``None`` stays ``None``)."""
    if value is None or isinstance(value, (int, float)):
        return value
    text = str(value).strip().upper().replace(" ", "")
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def format_bytes(value: float | None) -> str:
    """Human-readable bytes (``1.5 GiB``); ``None`` means no limit."""
    if value is None:
        return "unbounded memory"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
