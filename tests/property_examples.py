"""How many examples a Hypothesis property tries: fewer in the default run (CI's time budget),
the thorough count in the slow run.

The slow run is a run whose `-m` expression selects slow tests (`scripts/test.sh -m slow`), or
any run with TOKENLANE_THOROUGH_PROPERTIES=1. tests/conftest.py decides which before the test
modules are imported, and in the slow run it also selects every property test, so `-m slow`
runs each one with its thorough count.
"""

from __future__ import annotations

import os
import re

THOROUGH_ENV = "TOKENLANE_THOROUGH_PROPERTIES"

thorough = os.environ.get(THOROUGH_ENV) == "1"


def selects_slow(mark_expression: str) -> bool:
    """Whether a `-m` expression asks for the slow tests ("slow", "slow or gpu"), as opposed to
    leaving them out ("not slow and not e2e")."""
    return re.search(r"(?<!not )\bslow\b", mark_expression or "") is not None


def examples(default_run: int, *, thorough_run: int) -> int:
    """`max_examples` for a property: `default_run` examples, or `thorough_run` in the slow run."""
    if not 0 < default_run <= thorough_run:
        raise ValueError(f"expected 0 < default_run <= thorough_run, got {default_run} and {thorough_run}")
    return thorough_run if thorough else default_run
