"""Argument checks shared by the library, in one place, so every message has one form.

A bad argument is named as the call that was made: ``` `Cls(arg=value)` is not valid. Expected ...```
(the ``adaptiveload-train`` CLI rewrites that as the override ``node.arg=value``). Imports nothing
of the package.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

#: What to do with a bad manifest row, a bad shard or an oversize sample: raise, or skip and count it.
ON_BAD = ("error", "skip")


def _call(cls: str, name: str, value: Any) -> str:
    return f"`{cls}({name}={value!r})`" if cls else f"`{name}={value!r}`"


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive(cls: str, name: str, value: Any, *, integer: bool = False, zero: bool = False) -> float:
    """``value`` as a float when it is a finite number > 0 (with ``zero``: >= 0; with ``integer``: a whole
    one, e.g. ``4.0`` from YAML); else ``ValueError`` naming ``cls(name=value)``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if zero else value > 0)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        sign = "non-negative" if zero else "positive"
        kind = f"a {sign} integer" if integer else f"a {sign} finite number"
        raise ValueError(f"{_call(cls, name, value)} is not valid. Expected {kind}.")
    return float(value)


def check_positive_int(cls: str, name: str, value: Any) -> int:
    """``value`` as an int when it is an integer >= 1 (not a float, not a bool); else ``ValueError``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{_call(cls, name, value)} is not valid. Expected a positive integer.")
    return int(value)


def check_choice(cls: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices``; else ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"{_call(cls, name, value)} is not valid. Expected one of {tuple(choices)}.")
    return value


def check_triple(cls: str, name: str, value: Sequence[Any]) -> tuple[int, int, int]:
    """``value`` as three ints >= 1 (a patch size, a VAE stride, a token grid: (t, h, w)); else ``ValueError``."""
    try:
        ok = len(value) == 3 and all(not isinstance(v, bool) and int(v) == v and v >= 1 for v in value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        shown = tuple(value) if isinstance(value, (list, tuple)) else value
        raise ValueError(f"{_call(cls, name, shown)} is not valid. Expected three positive integers (t, h, w).")
    return int(value[0]), int(value[1]), int(value[2])
