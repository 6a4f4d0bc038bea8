"""Config trees as data: a dataclass tree filled from plain dicts, YAML files and `--key=value`
overrides, and back to plain dicts.

`from_dict` checks every value against its field's annotation (CLI strings are parsed: numbers,
bools, lists) and names the dotted field and the fix when one does not fit, or when a key is
unknown (with the new place of a key that moved, `MOVED`).
`read_yaml` reads a run file, `parse_overrides` the command line's `--a.b=c` list. Nothing here
knows what a run is: the config classes live in `earl.config` and `earl.placement`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path

import yaml

from earl.runtime.errors import FieldError

__all__ = ["MOVED", "from_dict", "parse_overrides", "read_yaml", "to_dict"]

# keys of earlier versions: where they went (an unknown-key error names the new place)
MOVED = {"algorithm.lr": "optim.lr", "algorithm.max_grad_norm": "optim.grad_clip",
         "algorithm.lr_anneal_from": "optim.lr_anneal_from",
         "algorithm.lr_final": "optim.lr_final",
         "algorithm.clip": "algorithm.clip_low and algorithm.clip_high",
         "selector_initial_context": "selector.initial_context",
         "placement.threads_per_actor": "placement.threads"}

def _fields(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


ON_OFF = ("selector.mode", "partial_rollouts")  # string fields whose values include "off"


def _coerce(value: object, tp: object, where: str) -> object:
    """Checks (and for CLI strings, parses) `value` against the annotated type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        short = getattr(tp, "SHORTHAND", "")
        if short and isinstance(value, (str, bool)):  # `--selector on` = --selector.mode=on
            value = {short: ("on" if value else "off") if isinstance(value, bool) else value}
        if not isinstance(value, dict):
            raise TypeError(f"config field {where!r} must be a mapping of {tp.__name__} fields, "
                            f"got {type(value).__name__}")
        return from_dict(tp, value, prefix=where + ".")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"config field {where!r}: {value!r} unknown; choose one of {args}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"config field {where!r} must be a mapping, got {value!r}")
        return {str(k): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[T, ...]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"config field {where!r} must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise TypeError(f"config field {where!r} must be a list of {len(args)} values, "
                            f"got {value!r}")
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"config field {where!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError(f"config field {where!r} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"config field {where!r} must be a finite number, got {value!r}")
            return float(value)
        raise TypeError(f"config field {where!r} must be a number, got {value!r}")
    if tp is str:
        if where in ON_OFF and isinstance(value, bool):  # YAML 1.1 reads on/off
            return "on" if value else "off"
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError(f"config field {where!r} must be a string, got {value!r}")
    raise TypeError(f"config field {where!r} has unsupported type {tp!r}")


def from_dict(cls: type, data: dict[str, object], *, prefix: str = "") -> typing.Any:
    """Builds config `cls` from a nested dict; the dataclass checks its own values.

    Raises:
        ValueError: unknown keys (naming them, and where a moved key went) or a value the
            dataclass refuses (naming the dotted field and the fix).
        TypeError: a value of the wrong type.
    """
    known = _fields(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        names = ", ".join(prefix + k + (f" (now {MOVED[prefix + k]})" if prefix + k in MOVED
                                        else "") for k in unknown)
        raise ValueError(f"unknown config key(s) {names}; valid keys under "
                         f"{prefix.rstrip('.') or 'the top level'}: {', '.join(known)}")
    defaults = {f.name: f.default_factory for f in dataclasses.fields(cls)
                if f.default_factory is not dataclasses.MISSING}
    kwargs = {}
    for k, v in data.items():
        if isinstance(v, dict) and k in defaults and dataclasses.is_dataclass(known[k]):
            v = _merge(to_dict(defaults[k]()), v)  # a section's own defaults, then `v`
        kwargs[k] = _coerce(v, known[k], prefix + k)
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ValueError(f"config field {prefix + e.field!r}: {e.message}") from None


def to_dict(cfg: object) -> dict[str, typing.Any]:
    """The config tree as plain nested dicts (for YAML/JSON dumps and checkpoints)."""
    return dataclasses.asdict(cfg)  # type: ignore[call-overload]


def parse_overrides(args: list[str]) -> dict[str, object]:
    """`["--a.b=1", "--c", "x"]` -> `{"a": {"b": 1}, "c": "x"}`; values are parsed as YAML."""
    out: dict[str, object] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"override {arg!r} must look like --key.sub=value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"override --{key} needs a value: --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        i += 1
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ValueError(  # noqa: TRY004 - a bad override string, not a type
                    f"override --{key} conflicts with an earlier --{part}=...")
            node = nxt
        if isinstance(node.get(parts[-1]), dict):
            raise ValueError(  # noqa: TRY004 - a bad override string, not a type
                f"override --{key}={raw} conflicts with an earlier --{key}.<field>"
                f"=...; write it as --{key}.<field>=... too (e.g. --selector.mode=on)")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, object], extra: dict[str, object]) -> dict[str, object]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)  # type: ignore[arg-type]
        else:
            out[k] = v
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, object]:
    """A YAML mapping from `path`, safely parsed (no `!!python` tags).

    Raises:
        ValueError: missing, binary or non-UTF-8 file, or a YAML error (names file and line).
        TypeError: the top level is not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {str(p)!r} does not exist; pass a YAML file path")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--config {str(p)!r} is not a UTF-8 text file; pass a YAML file"
                         ) from None
    if "\x00" in text:
        raise ValueError(f"--config {str(p)!r} is a binary file; pass a YAML file")
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"--config {where}: {what} (plain YAML only: no !!python tags)"
                         ) from None
    if not isinstance(loaded, dict):
        raise TypeError(f"config file {str(p)!r} must hold a mapping at the top level")
    return loaded
