"""`StrEnum`: enum members that are their string values, for reasons and verdicts that end up
in status, conditions and Events.

A member compares equal to its value, formats and `str()`s as its value, and `json.dumps`
writes the value, so text built from members is byte-identical to text built from the
strings. Python 3.10 has no `enum.StrEnum`; this is the same behaviour on every version.
A member is still a `str` subclass: status dicts take `str(member)` (yaml's safe dumper
refuses subclasses).
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    __str__ = str.__str__
    __format__ = str.__format__
