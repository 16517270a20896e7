"""Benchmarks of the library against its references; what they share."""

import statistics


def spread(values: list[float], digits: int = 2, unit: str = "") -> str:
    """`median unit [min-max]` of repeated measurements, `digits` decimals."""
    return f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
