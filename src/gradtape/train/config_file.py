"""Run options from a YAML file (``finetune --config run.yaml``) and the resolved options a
run folder keeps (``config.yaml``).

Generic over a config dataclass whose fields carry ``help``, ``check`` and ``kind`` in
their metadata (``train.options.FinetuneConfig``): a key is a field's flag name without
the dashes, spelled with ``-`` or ``_`` (``seq-len`` or ``seq_len``); an option on by
default is also turned off as its flag spells it (``no-packing: true``).  Every value goes
through the field's own type and range check, the message naming the file and the key.
Not here: which values win (the caller merges: defaults < file < command line), nor
reading any other format (``yaml.safe_load`` only: no tags, no Python objects).
"""

from __future__ import annotations

import dataclasses
import difflib
import os

from .. import checks
from ..errors import GradtapeError
from ..io import atomic_write_bytes


def options(cls) -> dict:
    """``{field name: field}`` of the options a file may set (those the CLI has)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("cli") is not False}


def _kind(f):
    return f.metadata.get("kind") or f.type


def _is_bool(f):
    return _kind(f) in ("bool", bool)


def _field_of(key, fields):
    """``(field, negated)`` for a key as a flag spells it, or None."""
    name = key.replace("-", "_")
    if name in fields:
        return fields[name], False
    if name.startswith("no_") and name[3:] in fields:
        f = fields[name[3:]]
        if _is_bool(f) and f.default is True:
            return f, True
    return None


def read_config(path, cls, name="--config") -> dict:
    """``{field name: checked value}`` from a YAML mapping of options; one-line errors
    naming the file (and the key) for a file that is not YAML or not a mapping, an unknown
    or repeated key, and a value of the wrong type or out of range."""
    import yaml

    p = checks.input_path(path, name, "file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GradtapeError(f"{name} {p}: is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise GradtapeError(f"{name} {p}: cannot be read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or type(e).__name__
        raise GradtapeError(f"{name} {p}: is not YAML ({what}{where})") from None
    if data is None:  # an empty file (or only comments): no options
        return {}
    if not isinstance(data, dict):
        raise GradtapeError(f"{name} {p}: is not a mapping of options (key: value lines), "
                            f"it holds a {type(data).__name__}")
    fields, out, seen = options(cls), {}, {}
    for key, value in data.items():
        label = f"{name} {p}: {key if isinstance(key, str) else repr(key)[:40]}"
        hit = _field_of(key, fields) if isinstance(key, str) else None
        if hit is None:
            spellings = sorted({f.replace("_", "-") for f in fields})
            close = difflib.get_close_matches(str(key).replace("_", "-"), spellings, n=1)
            raise GradtapeError(f"{label}: not a finetune option"
                                + (f" (did you mean {close[0]}?)" if close else ""))
        f, negated = hit
        if f.name in seen:
            raise GradtapeError(f"{label}: {f.name.replace('_', '-')} is set twice (also as "
                                f"{seen[f.name]})")
        seen[f.name] = key
        out[f.name] = _checked(label, f, value, negated)
    return out


def _checked(label, f, value, negated):
    kind, meta = _kind(f), f.metadata
    if value is None and "kind" in meta:  # an optional number left to its default
        return None
    # YAML 1.1 reads 1e-3 (no dot) as a string: a number field takes it as the number
    if kind in ("float", float) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass  # the type check below says it
    if isinstance(value, (list, dict)):  # (not shown: YAML aliases can make it huge)
        raise GradtapeError(f"{label} must be one value, got a "
                            f"{'list' if isinstance(value, list) else 'mapping'}")
    if kind in ("str", str) and isinstance(value, bool):
        raise GradtapeError(f"{label} must be a string, got {value!r} (YAML reads on, off, "
                            "yes and no as true or false: quote the word)")
    checks.check_type(label, value, kind)
    if negated:
        value = not value
    if meta.get("check") is not None:
        meta["check"](label, value)
    return value


def resolved_yaml(cfg) -> str:
    """Every option of ``cfg`` (a config dataclass) by its flag name, as YAML that
    ``read_config`` reads back to the same values."""
    import yaml

    values = {f.name.replace("_", "-"): getattr(cfg, f.name) for f in options(type(cfg)).values()}
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


def write_resolved(path, cfg):
    """``config.yaml`` in a run folder: the options the run took, written atomically."""
    atomic_write_bytes(os.fspath(path), resolved_yaml(cfg).encode("utf-8"))
