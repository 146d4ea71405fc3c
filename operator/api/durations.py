"""The one duration grammar of the operator: the CRD's (`schema.DURATION_PATTERN`).

A duration is one or more `<number><unit>` parts, units ms, s, m, h: "30s", "5m", "1h30m",
"1.5h", "250ms". Every `spec.*` duration (tuning, rollout, autoscaling, monitoring) is
validated against this pattern by the API server, and parsed here.
"""

from __future__ import annotations

import re
from typing import Any

from tokenlane.operator.api.schema import DURATION_PATTERN

_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: Any, where: str = "") -> float:
    """Seconds in a Go-style duration ('90s', '5m', '1h30m'). ValueError for anything else,
    naming `where` (the field, e.g. "spec.tuning.window") when given."""
    prefix = f"{where}: " if where else ""
    if not isinstance(text, str):
        raise ValueError(f"{prefix}expected a duration string like 30s, 5m or 1h30m, "
                         f"got {type(text).__name__} {text!r}")
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{prefix}{text!r} is not a duration like 30s, 5m or 1h30m "
                         "(one or more <number><unit> parts, units ms, s, m, h)")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _PART.findall(text))
