"""The calibration record: what was profiled, what was fitted, and what it is valid for.

A record is versioned JSON (never pickle: calibrations move between machines)::

    {"format": "lightning_adaptiveload.Calibration", "version": 2,
     "key": {...what determines cost...},
     "cost_model": {...}, "memory_model": {...} | null,
     "device_memory": bytes | null, "optimizer_bytes": bytes not yet allocated when profiling,
     "measurements": [{batch_size, grid, seq_len, time_s, peak_bytes, status, timed_steps, seconds}],
     "profile_seconds": float, "world_size": ranks it was profiled on (informational),
     "extra": {"provenance": {"source": "profiled" | "corrected", ...}, ...} (optional)}

``extra["provenance"]`` says where the numbers come from: ``{"source": "profiled"}`` (with
``"provisional": reason`` for a profile too noisy to keep as final: the cache does not serve it), or
``{"source": "corrected", "training_steps": N, ...}`` for a calibration refitted with training's own steps
(:func:`~lightning_adaptiveload.calibration.feedback.refit`). A record without it (written before it
existed) is a profile.

The key holds what a step's cost depends on: the model's architecture (parameter names, shapes and
dtypes), the device type and name, precision, strategy, cost-model form and the profiled grid. It
leaves out what does not change the cost of a sample (world size, learning rate, logging paths,
thread counts), so a resume on another number of ranks or with another learning rate reuses it.

:func:`read_cache` treats a file that fails the schema like a stale one (a warning naming the file),
and :func:`write_cache` writes atomically and removes temp files that a killed writer left behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.calibration.profile import Measurement

FORMAT = "lightning_adaptiveload.Calibration"
VERSION = 2
_CACHE_PREFIX = "calibration_"
_STALE_TMP_S = 600.0


class CalibrationError(ValueError):
    """A calibration record is unreadable or fails its schema."""


# Name parts that wrappers (FSDP, activation checkpointing, torch.compile) insert.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def _config_of(module: Any) -> Any:
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None)
        if config is not None and not callable(config):
            return config
    return None


def model_fingerprint(module: Any) -> str:
    """Hash of a model's architecture, independent of how it is sharded.

    The model's ``config`` (a dataclass or mapping, on the module or its ``.model``, e.g. a
    ``WanConfig`` or a diffusers config) when there is one; else every parameter's name (wrapper
    prefixes removed), global shape and dtype. Two models with the same fingerprint run the same
    matmuls per sample, and a module that never called ``save_hyperparameters`` still gets a key that
    changes with its depth or width.
    """
    h = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}".encode())
    config = _config_of(module)
    if config is not None:
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        h.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
        return h.hexdigest()[:32]
    for name, p in module.named_parameters():
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        # A DTensor (FSDP2) reports its global shape; a flat FSDP1 parameter has no per-layer shape.
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:32]


@dataclass
class Calibration:
    """A profile and its fits (see the module docstring for the JSON form)."""

    key: dict[str, Any]
    cost_model: CostModel
    measurements: list[Measurement]
    memory_model: MemoryModel | None = None
    device_memory: int | None = None
    optimizer_bytes: int = 0
    profile_seconds: float = 0.0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "key": self.key,
            "cost_model": self.cost_model.to_dict(),
            "memory_model": None if self.memory_model is None else self.memory_model.to_dict(),
            "device_memory": self.device_memory, "optimizer_bytes": int(self.optimizer_bytes),
            "measurements": [m.to_dict() for m in self.measurements],
            "profile_seconds": float(self.profile_seconds), "world_size": int(self.world_size),
            **({"extra": self.extra} if self.extra else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, source: str = "calibration") -> Calibration:
        """Validate and read a record; ``source`` (a file name) goes into every error.

        Raises:
            CalibrationError: the record is not an object of this format and version, or a field is
                missing or of the wrong type.
        """
        def bad(what: str) -> CalibrationError:
            return CalibrationError(f"{source}: {what}. Delete it or profile again (`force=True`).")

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f"not a calibration record (expected format={FORMAT!r})")
        if data.get("version") != VERSION:
            raise bad(f"calibration version {data.get('version')!r} is not supported (this release reads {VERSION})")
        key = data.get("key")
        if not isinstance(key, dict):
            raise bad(f"`key` is {key!r}, expected an object")
        try:
            cost_model = CostModel.from_dict(data.get("cost_model"))
            mm = data.get("memory_model")
            memory_model = None if mm is None else MemoryModel.from_dict(mm)
        except (ValueError, TypeError) as err:
            raise bad(f"invalid model ({err})") from err
        meas = data.get("measurements")
        if not isinstance(meas, list) or not meas:
            raise bad("`measurements` is missing or empty")
        try:
            measurements = [Measurement.from_dict(m) for m in meas]
        except ValueError as err:
            raise bad(f"invalid measurement ({err})") from err
        dev = data.get("device_memory")
        opt = data.get("optimizer_bytes", 0)
        secs = data.get("profile_seconds", 0.0)
        ws = data.get("world_size", 1)
        if dev is not None and not (isinstance(dev, int) and dev > 0):
            raise bad(f"`device_memory` is {dev!r}, expected a positive integer or null")
        if not (isinstance(opt, int) and opt >= 0):
            raise bad(f"`optimizer_bytes` is {opt!r}, expected an integer >= 0")
        if not (isinstance(secs, (int, float)) and math.isfinite(secs) and secs >= 0):
            raise bad(f"`profile_seconds` is {secs!r}, expected seconds >= 0")
        if not (isinstance(ws, int) and ws >= 1):
            raise bad(f"`world_size` is {ws!r}, expected an integer >= 1")
        return cls(key, cost_model, measurements, memory_model, dev, opt, float(secs), ws,
                   dict(data.get("extra") or {}))

    @classmethod
    def from_json(cls, text: str, source: str = "calibration") -> Calibration:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CalibrationError(f"{source}: not valid JSON ({err}). Delete it or profile again.") from err
        return cls.from_dict(data, source)


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a calibration JSON (e.g. the ``shape_benchmark.json`` a run wrote).

    Raises:
        FileNotFoundError: no such file.
        CalibrationError: the file is not a valid calibration (the message names it).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"calibration file {str(file)!r} does not exist.")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise CalibrationError(f"{file}: unreadable ({err}). Delete it or profile again.") from err
    return Calibration.from_json(text, source=str(file))


def load_cost_model(path: str | os.PathLike, argument: str = "path") -> CostModel:
    """A ``CostModel`` from a calibration JSON or a ``CostModel.to_json()`` file.

    ``argument`` names the setting the path came from, for the error message.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"cost model file {str(file)!r} does not exist; point `{argument}` at the calibration JSON a run "
            "wrote (shape_benchmark.json) or a CostModel.to_json() file."
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CalibrationError(f"{file} (`{argument}`): not valid JSON ({err}).") from err
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return Calibration.from_dict(data, source=str(file)).cost_model
    try:
        return CostModel.from_dict(data)
    except ValueError as err:
        raise CalibrationError(f"{file} (`{argument}`): {err}") from err


def cache_path(cache_dir: str | os.PathLike, key: dict[str, Any]) -> Path:
    """Where the calibration of ``key`` lives in ``cache_dir``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir).expanduser() / f"{_CACHE_PREFIX}{digest}.json"


def read_cache(cache_dir: str | os.PathLike, key: dict[str, Any]) -> Calibration | None:
    """The cached calibration for ``key``, or ``None`` (missing, stale or invalid: warned)."""
    path = cache_path(cache_dir, key)
    if not path.is_file():
        return None
    try:
        cal = load_calibration(path)
    except (CalibrationError, FileNotFoundError) as err:
        warnings.warn(f"ignoring the calibration cache file {path}: {err}", stacklevel=2)
        return None
    if cal.key != key:
        return None  # a hash collision or an edited file: profile again
    return cal


def provenance(calibration: Calibration) -> dict[str, Any]:
    """``extra["provenance"]`` (see the module docstring); ``{"source": "profiled"}`` for older records."""
    found = (calibration.extra or {}).get("provenance")
    return dict(found) if isinstance(found, dict) and found.get("source") else {"source": "profiled"}


def describe_provenance(calibration: Calibration) -> str:
    """Where a calibration's numbers come from, in words: ``"profiled"``, ``"profiled, provisional (why)"`` or
    ``"corrected from N training steps"``."""
    prov = provenance(calibration)
    if prov["source"] == "corrected":
        return f"corrected from {int(prov.get('training_steps', 0)):,} training steps"
    why = prov.get("provisional")
    return f"{prov['source']}, provisional ({why})" if why else str(prov["source"])


def is_provisional(calibration: Calibration) -> bool:
    """Whether the record is a profile too noisy to serve from the cache (the next run profiles again)."""
    return bool(provenance(calibration).get("provisional"))


def write_cache(cache_dir: str | os.PathLike, calibration: Calibration,
                provenance: dict[str, Any] | None = None) -> Path:
    """Write ``calibration`` as the cache entry of its key, replacing any entry there (a corrected
    calibration replaces the profile it corrected); with ``provenance``, as its ``extra["provenance"]``.
    Atomic (a reader never sees half a file); temp files of killed writers are removed."""
    if provenance is not None:
        calibration = dataclasses.replace(calibration, extra={**calibration.extra, "provenance": dict(provenance)})
    path = cache_path(cache_dir, calibration.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for stale in path.parent.glob(f"{path.name}.tmp*"):
        try:
            # Only files no live writer can own: a write takes milliseconds.
            if now - stale.stat().st_mtime > _STALE_TMP_S:
                stale.unlink()
        except OSError:
            pass
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(calibration.to_json())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
