"""The JSON ratchet stores, and the check an output passes before it is stored.

Two halves, one rule about what a stored value may hold:

- **The store's codec** (:func:`dumps`, :func:`loads`): every event, snapshot and
  transcript fragment is written and read through it, so the decoder accepts
  exactly the values the encoder writes (tests/test_json_values.py, a property
  test). A lone surrogate (``"\\ud83d"``, half of a UTF-16 pair: not a Unicode
  character, and not encodable as UTF-8) is read and written as U+FFFD both ways;
  ``NaN`` and ``±Infinity`` (not JSON) as null both ways, as pydantic always wrote
  them to Redis and older builds read them from SQLite logs (:func:`canonical`).
  Integers of more than :data:`MAX_INT_DIGITS` digits (Python's own limit for
  turning an int into text), text that is not UTF-8 and anything but the JSON
  types are refused both ways, as :class:`~runtime.errors.NotStorable`.
- **The check at the boundary** (:func:`checked`): what a model, a tool or a probe
  hands back is checked where it crosses into ratchet, before it is journaled, so
  that it can always be saved and folded as it is. It refuses what the codec
  refuses or would change (NaN, infinities), a value over ``max_bytes`` and one
  nested deeper than :data:`MAX_DEPTH`, saying why in one line for the model to
  read. Whether a lone surrogate is replaced
  (a result, a model's text) or refused (a tool's arguments: the tool would act on
  a value the model did not send) is the caller's choice.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final, Literal

from runtime.errors import NotStorable

MAX_INT_DIGITS: Final = 4300
"""The most decimal digits an integer may have: CPython's default
``sys.get_int_max_str_digits()``, beyond which ``json`` can neither write nor read it."""
MAX_DEPTH: Final = 100
"""The deepest an output may nest lists and objects (the encoders recurse)."""
MAX_OUTPUT_BYTES: Final = 1024 * 1024
"""The most a tool's or a probe's result, a model's text or a call's arguments may take as
UTF-8 JSON (docs/tools.md). A snapshot holds the whole transcript in 16 MiB."""

_INT_LIMIT: Final = 10**MAX_INT_DIGITS
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (the same object if it has none).

    A high surrogate followed by a low one is the character they encode, as a JSON
    decoder reads the escapes ``"\\ud83d\\ude00"``: so a value is written as it is read.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def has_surrogates(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


# --- the store's codec ----------------------------------------------------------------


def dumps(
    value: Any, *, sort_keys: bool = False, separators: tuple[str, str] | None = (",", ":")
) -> bytes:
    """``canonical(value)`` as UTF-8 JSON; NotStorable for what :func:`loads` cannot read."""
    try:
        text = json.dumps(
            value, ensure_ascii=False, allow_nan=False, sort_keys=sort_keys, separators=separators
        )
        return text.encode("utf-8")
    except (UnicodeEncodeError, ValueError) as exc:
        if not isinstance(exc, UnicodeEncodeError) and "Out of range float" not in str(exc):
            raise NotStorable(_why(exc)) from None
        # Rare: only then is the value walked, and written as loads reads it back.
        return dumps(canonical(value), sort_keys=sort_keys, separators=separators)
    except (TypeError, RecursionError) as exc:
        raise NotStorable(_why(exc)) from None


def loads(data: bytes | str) -> Any:
    """The value of a JSON document, canonical (:func:`canonical`); NotStorable if it is one
    :func:`dumps` cannot write."""
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotStorable(f"not UTF-8 at byte {exc.start}") from None
    try:
        value = _decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise NotStorable(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise NotStorable(_why(exc)) from None
    if "\\ud" in text or "\\uD" in text:  # a lone surrogate can only come from an escape
        value = replaced(value)
    return value


def replaced(value: Any) -> Any:
    """``value`` with lone surrogates in its strings and keys replaced by U+FFFD."""
    if isinstance(value, str):
        return without_surrogates(value)
    if isinstance(value, dict):
        return {
            without_surrogates(k) if isinstance(k, str) else k: replaced(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [replaced(v) for v in value]
    return value


def canonical(value: Any) -> Any:
    """``value`` as the store reads it back: :func:`replaced`, and NaN or an infinity null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {
            without_surrogates(k) if isinstance(k, str) else k: canonical(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return without_surrogates(value) if isinstance(value, str) else value


def _no_number(name: str) -> None:
    """``NaN``, ``Infinity``: an older build wrote them (SQLite); they read as null."""
    return None


def _float_or_none(text: str) -> float | None:
    number = float(text)
    return number if math.isfinite(number) else None  # 1e400


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    text = str(exc)
    if "integer string conversion" in text:
        return f"an integer of more than {MAX_INT_DIGITS} digits"
    return " ".join(text.split())[:160]


# --- the check at the boundary ----------------------------------------------------------


def checked(
    value: Any,
    *,
    max_bytes: int = MAX_OUTPUT_BYTES,
    surrogates: Literal["replace", "refuse"] = "replace",
) -> tuple[Any, int]:
    """``value`` as it may be stored, and its size as UTF-8 JSON; NotStorable saying why not.

    ``value`` must already be plain (``to_jsonable_python``): str, int, float, bool, None,
    lists and objects with string keys. ``surrogates``: ``"replace"`` them by U+FFFD, or
    ``"refuse"`` the value.
    """
    try:
        plain = _plain(value, 0, surrogates == "replace")
    except RecursionError:
        raise NotStorable(f"nests deeper than {MAX_DEPTH} levels") from None
    size = len(dumps(plain))
    if size > max_bytes:
        raise NotStorable(f"is {size} bytes as JSON, over the {max_bytes}-byte limit")
    return plain, size


def _plain(value: Any, depth: int, replace: bool) -> Any:
    if isinstance(value, list | tuple | dict):
        if depth >= MAX_DEPTH:
            raise NotStorable(f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            out = {}
            for key, entry in value.items():
                if not isinstance(key, str):
                    raise NotStorable(
                        f"holds an object key that is a {type(key).__name__}, not a string"
                    )
                out[_plain(key, depth, replace)] = _plain(entry, depth + 1, replace)
            return out
        return [_plain(v, depth + 1, replace) for v in value]
    return _scalar(value, replace)


def _scalar(value: Any, replace: bool) -> Any:
    if isinstance(value, str):
        if has_surrogates(value):
            if not replace:
                raise NotStorable(
                    f"holds a lone surrogate ({_surrogate(value)}), which is not Unicode"
                )
            return without_surrogates(value)
        return str(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -_INT_LIMIT < value < _INT_LIMIT:
            digits = int(value.bit_length() * 0.30103)
            raise NotStorable(
                f"holds an integer of about {digits} digits, over {MAX_INT_DIGITS}; "
                "return it as a string"
            )
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotStorable(f"holds {value!r}, which is not a JSON number")
        return float(value)
    raise NotStorable(f"holds a {type(value).__name__}, which is not a JSON value")


def _surrogate(text: str) -> str:
    found = _SURROGATE.search(text)
    return f"\\u{ord(found.group()):04x}" if found is not None else "?"


_decoder = json.JSONDecoder(parse_constant=_no_number, parse_float=_float_or_none)
"""What :func:`loads` reads with: ``json.loads`` with these hooks builds one per call."""
