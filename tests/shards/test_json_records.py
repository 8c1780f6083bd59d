"""``shards.json_records``: dataclasses to and from JSON objects, each value's type
checked with the field path named, optional fields left out where absent, unknown
keys kept."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from shards.json_records import JsonRecord, RecordError, json_kind, spec


def _even(value: int) -> str | None:
    return None if value % 2 == 0 else f"{value} is odd"


@dataclass(frozen=True, kw_only=True)
class Part(JsonRecord):
    name: str
    size: int = field(metadata=spec(count=True))
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Whole(JsonRecord):
    title: str
    ratio: float
    done: bool
    parts: tuple[Part, ...] = field(metadata=spec(expected="a list of parts"))
    tags: dict[str, int]
    note: str | None = None
    pair: int = field(default=2, metadata=spec(check=_even))
    anything: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)


_VALUE = {"title": "t", "ratio": 1, "done": False, "parts": [{"name": "a", "size": 0}, {"name": "b", "size": 3}],
          "tags": {"x": 1}, "pair": 4, "anything": {"deep": [1, None]}}


def test_a_value_round_trips_in_field_order() -> None:
    whole = Whole.from_json(_VALUE)
    assert whole.parts == (Part(name="a", size=0), Part(name="b", size=3)) and whole.note is None
    assert json.dumps(whole.to_json()) == json.dumps(_VALUE)  # same keys, same order, note left out


def test_unknown_keys_are_kept_and_written_after_the_fields() -> None:
    value = {"later": 1, **_VALUE, "parts": [{"name": "a", "size": 0, "colour": "red"}]}
    whole = Whole.from_json(value)
    assert whole.extra == {"later": 1} and whole.parts[0].extra == {"colour": "red"}
    assert whole.to_json() == value and list(whole.to_json())[-1] == "later"


def test_a_default_that_is_not_none_is_written() -> None:
    assert Whole.from_json({k: v for k, v in _VALUE.items() if k != "pair"}).to_json()["pair"] == 2


@pytest.mark.parametrize(("change", "message"), [
    ({"title": 1}, "title: expected a string, got a number"),
    ({"ratio": "1"}, "ratio: expected a number, got a string"),
    ({"ratio": True}, "ratio: expected a number, got true"),
    ({"done": 0}, "done: expected true or false, got a number"),
    ({"parts": {}}, "parts: expected a list of parts, got an object"),
    ({"parts": [{"name": "a", "size": 1}, 3]}, "parts[1]: expected an object, got a number"),
    ({"parts": [{"name": "a", "size": -1}]}, "parts[0].size: expected a count (0 or more), got -1"),
    ({"parts": [{"name": "a", "size": 1.0}]}, "parts[0].size: expected an integer, got a number"),
    ({"parts": [{"size": 1}]}, "parts[0].name: missing, expected a string"),
    ({"tags": {"x": False}}, "tags.x: expected an integer, got false"),
    ({"note": None}, "note: expected a string, got null"),
    ({"pair": 3}, "pair: 3 is odd"),
])
def test_a_wrong_value_names_its_path(change: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError) as caught:
        Whole.from_json(_VALUE | change)
    assert str(caught.value) == message and message.startswith(caught.value.field + ":")


def test_a_value_that_is_not_an_object_names_where_it_is() -> None:
    with pytest.raises(RecordError, match="^expected a whole, got a list$"):
        Whole.from_json([], expected="a whole")
    assert [json_kind(v) for v in ({}, [], "", 1.5, True, None)] == [
        "an object", "a list", "a string", "a number", "true", "null"]
