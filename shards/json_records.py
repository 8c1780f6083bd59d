"""Frozen dataclasses read from and written to JSON objects, with every value's type
checked on the way in and errors that name the field path (``splits.train.shards[3].
sha256: expected a string, got a number``).

A record is a ``@dataclass(frozen=True, kw_only=True)`` subclass of :class:`JsonRecord`
whose fields are, in the order they are written: ``str``, ``int``, ``bool``,
``float``, ``tuple[X, ...]`` (a JSON list), ``dict[str, X]`` (a JSON object), another
record, ``Any`` (any JSON value, kept as it is), or ``X | None``. A field with a
default is optional; one whose default is ``None`` is left out when it is ``None``,
so a record read from JSON that lacked the key writes back without it. Keys a
record does not declare are kept in its ``extra`` and written back after its fields:
reading and writing again loses nothing.

Field metadata (:func:`spec`) refines the messages and the checks: ``expected``
(what the value should be, in words), ``item`` (the same for each item of a list or
each value of an object), ``count`` (an integer of 0 or more) and ``check`` (a
function of the value read that returns what is wrong with it, or None).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar, Union

__all__ = ["JsonRecord", "RecordError", "json_kind", "spec"]

R = TypeVar("R", bound="JsonRecord")
_ABSENT = object()  # a key the JSON object lacks, told apart from a JSON null
_WORDS: dict[object, str] = {str: "a string", int: "an integer", bool: "true or false", float: "a number",
                             tuple: "a list", dict: "an object"}


class RecordError(ValueError):
    """A JSON value that is not what a record field holds.

    Attributes:
        field: the field's path (``splits.train.shards[0].path``; "" for the whole value).
        reason: what is wrong (``expected a string, got a number``).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason


def spec(*, expected: str = "", item: str = "", count: bool = False,
         check: Callable[[Any], str | None] | None = None) -> dict[str, Any]:
    """Metadata of a record field (``dataclasses.field(metadata=spec(...))``).

    Args:
        expected: the value in words, for messages (default: from its type).
        item: each item of a list field, or each value of an object field, in words.
        count: the value is an integer of 0 or more.
        check: returns what is wrong with the value read (a message), or None.
    """
    return {"expected": expected, "item": item, "count": count, "check": check}


def json_kind(value: object) -> str:
    """What ``value`` is in JSON words: ``an object``, ``a list``, ``a string``, ``a
    number``, ``true`` / ``false`` or ``null``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((dict, "an object"), (list, "a list"), (str, "a string"), ((int, float), "a number"))
    return next((kind for types_, kind in kinds if isinstance(value, types_)), "null")


class JsonRecord:
    """Base of the records: :meth:`from_json` and :meth:`to_json`."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    extra: Mapping[str, Any]

    @classmethod
    def from_json(cls: type[R], value: object, where: str = "", expected: str = "an object") -> R:
        """The record held by JSON value ``value`` (as ``json.loads`` returns it).

        Args:
            value: a JSON object.
            where: the field path of ``value``, for messages ("" for the top).
            expected: ``value`` in words where it is not an object.

        Raises:
            RecordError: a value of another type, a missing key, or one a check
                refuses (names the field path).
        """
        if not isinstance(value, dict):
            raise _wrong(where, value, expected)
        kwargs: dict[str, Any] = {}
        hints = _hints(typing.cast(type, cls))
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name == "extra":
                continue
            raw = value.get(f.name, _ABSENT)
            if raw is _ABSENT:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(_at(where, f.name), f"missing, expected {_expected(f, hints[f.name])}")
                continue
            kwargs[f.name] = _field_value(f, hints[f.name], raw, _at(where, f.name))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}  # type: ignore[arg-type]
        kwargs["extra"] = {k: v for k, v in value.items() if k not in names}
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        """This record as a JSON object: its fields in order (a ``None`` that is the
        default left out), then its ``extra`` keys."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name != "extra" and not (value is None and f.default is None):
                out[f.name] = _dumped(value)
        out.update(self.extra)
        return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _wrong(where: str, value: object, expected: str) -> RecordError:
    return RecordError(where, f"expected {expected}, got {json_kind(value)}")


def _words(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type) and issubclass(origin, JsonRecord):
        return "an object"
    return _WORDS.get(origin, "a JSON value")


def _optional(hint: Any) -> Any:
    """``X`` of ``X | None`` (else ``hint``)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _expected(f: dataclasses.Field[Any], hint: Any) -> str:
    return f.metadata.get("expected") or _words(_optional(hint))


def _field_value(f: dataclasses.Field[Any], hint: Any, raw: object, where: str) -> Any:
    hint = _optional(hint)
    value = _value(hint, raw, where, _expected(f, hint), f.metadata.get("item", ""))
    if f.metadata.get("count") and value < 0:
        raise RecordError(where, f"expected a count (0 or more), got {value}")
    check = f.metadata.get("check")
    if check is not None and (problem := check(value)):
        raise RecordError(where, problem)
    return value


def _value(hint: Any, raw: object, where: str, expected: str, item: str = "") -> Any:
    """``raw`` as a value of type ``hint``."""
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is Any:
        return raw
    if isinstance(origin, type) and issubclass(origin, JsonRecord):
        return origin.from_json(raw, where, expected)
    if origin is tuple:
        if not isinstance(raw, list):
            raise _wrong(where, raw, expected)
        return tuple(_value(args[0], v, f"{where}[{i}]", item or _words(args[0])) for i, v in enumerate(raw))
    if origin is dict:
        if not isinstance(raw, dict):
            raise _wrong(where, raw, expected)
        return {k: _value(args[1], v, _at(where, k), item or _words(args[1])) for k, v in raw.items()}
    if not _is_instance(raw, origin):
        raise _wrong(where, raw, expected)
    return raw


def _is_instance(raw: object, kind: type) -> bool:
    if kind is float:
        return isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if kind is int:
        return isinstance(raw, int) and not isinstance(raw, bool)
    return isinstance(raw, kind)


def _dumped(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, tuple):
        return [_dumped(v) for v in value]
    if isinstance(value, dict):
        return {k: _dumped(v) for k, v in value.items()}
    return value
