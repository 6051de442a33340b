"""The levers' short names, in arms of the studies and in `lowmem plan --levers`: one vocabulary, read from the
levers' cards (``lowmem.techniques.registry``). Apart from the registry because the trainer never parses a name: the
registry is on every WRN run's code path, and a change here retrains nothing.
"""

from __future__ import annotations

from typing import Any

from lowmem.techniques.registry import Lever, levers


def parse(text: str) -> dict[str, Any]:
    """Techniques fields from short names joined by '+' ('half-bf16+microbatch-8+checkpoint-block', 'sr-sgd'; 'plain'
    or 'baseline' for none): what arms of the studies and `lowmem plan --levers` are called. ValueError, listing the
    forms, for anything else; the values themselves are Techniques' to check."""
    out: dict[str, Any] = {}
    for token in [] if text in ("plain", "baseline") else text.split("+"):
        field, value = _short(token)
        if field in out:
            raise ValueError(f"{text!r} sets {field} twice")
        out[field] = value
    return out


def short_forms() -> list[str]:
    """The short names, one entry per lever a WRN run can set."""
    return [lv.short or "|".join(map(str, lv.settings)) for lv in levers().values() if lv.field]


def _short(token: str) -> tuple[str, Any]:
    for lv in levers().values():
        prefix = lv.short.split("-")[0] + "-"
        if lv.field and lv.short and token.startswith(prefix):
            value = token[len(prefix):]
            kind = type(lv.settings[0])  # the field's type, as its off setting has it
            try:
                return lv.field, kind(value)
            except ValueError:
                break
        if lv.field and not lv.short and token in lv.settings:
            return lv.field, token
    raise ValueError(f"{token!r} is none of the levers' short names ({', '.join(short_forms())}), joined by '+', "
                     "or 'plain'")


def get(name: str) -> Lever:
    """The lever ``name``; ValueError listing the levers for any other name."""
    if name not in levers():
        raise ValueError(f"no lever {name!r}: the levers are {', '.join(levers())}")
    return levers()[name]
