"""Command-line entry points.

Importing this package registers the resolver ``conf/`` uses: ``${adaptiveload.select:key,default}`` is
OmegaConf's ``oc.select`` where a null value also takes the default, so the top-level ``m_mem: null``
leaves each node that reads it its own default (2048 for a kept policy, 4096 for the CPU shape benchmark).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def _select(key: str, default: Any = None, *, _root_: Any) -> Any:
    value = OmegaConf.select(_root_, key, default=None)
    return default if value is None else value


if not OmegaConf.has_resolver("adaptiveload.select"):
    OmegaConf.register_new_resolver("adaptiveload.select", _select)
