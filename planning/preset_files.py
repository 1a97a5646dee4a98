"""A preset by name, or a JSON file of a dataclass's fields: what
`--system` and `--framework` take. Every refusal is one line naming the
flag or the file."""

import dataclasses
import json
from typing import Callable, Mapping, Optional


def load(flag: str, name_or_path: str, presets: Mapping, cls, *,
         kind: str, check: Optional[Callable[[str, dict], None]] = None,
         where: str = ""):
    """`presets[name_or_path]`, else `cls(**fields)` of the JSON file
    (its `name` defaults to the path). `check(path, fields)` raises
    ValueError on a field's bad value before `cls` is built; `where` is
    said after the list of fields a file may hold."""
    if name_or_path in presets:
        return presets[name_or_path]
    if not name_or_path.endswith(".json"):
        raise ValueError(f"{flag} {name_or_path!r}: not a preset "
                         f"({', '.join(presets)}) nor a .json file")
    try:
        with open(name_or_path) as f:
            fields = json.load(f)
    except ValueError as e:
        raise ValueError(f"{name_or_path}: not JSON ({e})") from None
    known = sorted(f.name for f in dataclasses.fields(cls))
    holds = f"a {kind} file holds {known}{where}"
    if not isinstance(fields, dict) or not fields:
        raise ValueError(f"{name_or_path}: empty; {holds}")
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{name_or_path}: unknown field(s) {unknown}; "
                         f"{holds}")
    if check is not None:
        check(name_or_path, fields)
    fields.setdefault("name", name_or_path)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name_or_path}: {e}") from None
