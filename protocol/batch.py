"""A batch's small fields, one record from the daemon's producer to the training
loop: :class:`BatchMeta`. :func:`to_message` writes it into a ``feeder.v1.Batch`` and
:func:`from_message` reads it back; both go field by field over the dataclass, so a
new per-batch field is a field of ``Batch`` in ``protos/feeder.proto`` and one here,
and nothing in between changes. The rest of ``Batch`` (``shape``, the ``pixels``
oneof, ``filler``) says where the pixels are: the transports' business.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from protos import feeder_pb2

__all__ = ["PIXEL_FIELDS", "BatchMeta", "from_message", "to_message"]

# Fields of ``Batch`` that are not the batch's small fields.
PIXEL_FIELDS = frozenset({"shape", "images", "shm", "cuda", "filler"})

_FIELDS = feeder_pb2.Batch.DESCRIPTOR.fields_by_name
# numpy dtype of each repeated numeric wire type, as read back.
_DTYPES = {
    FieldDescriptor.CPPTYPE_INT64: np.int64,
    FieldDescriptor.CPPTYPE_INT32: np.int32,
    FieldDescriptor.CPPTYPE_BOOL: np.bool_,
    FieldDescriptor.CPPTYPE_DOUBLE: np.float64,
    FieldDescriptor.CPPTYPE_FLOAT: np.float32,
}


@dataclass(frozen=True)
class BatchMeta:
    """Everything about a batch but its pixels (each field is the ``Batch`` field of
    the same name).

    Attributes:
        epoch: Epoch the batch belongs to.
        cursor: Sample cursor after this batch (the resume point).
        samples_per_rank: Length of this rank's part of the epoch, in samples.
        keys: Sample keys, in batch order.
        labels: int64 ``[N]``.
        padding: bool ``[N]``, True where a sample repeats another one: to fill the
            last batch, or in place of a sample that could not be served.
        failed_keys: Keys of samples that could not be served, replaced in this
            batch by repeats marked in ``padding``.
    """

    epoch: int
    cursor: int
    samples_per_rank: int
    keys: list[str]
    labels: np.ndarray
    padding: np.ndarray
    failed_keys: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


def _to_wire(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _from_wire(name: str, value: Any) -> Any:
    descriptor = _FIELDS[name]
    if not descriptor.is_repeated:
        return value
    if descriptor.cpp_type in _DTYPES:
        return np.array(value, dtype=_DTYPES[descriptor.cpp_type])
    return list(value)


def to_message(meta: BatchMeta, shape: tuple[int, ...]) -> feeder_pb2.Batch:
    """A ``Batch`` with ``meta``'s fields and the pixels' ``shape``, pixels not set."""
    values = {f.name: _to_wire(getattr(meta, f.name)) for f in dataclasses.fields(meta)}
    return feeder_pb2.Batch(shape=list(shape), **values)


def from_message(message: feeder_pb2.Batch) -> BatchMeta:
    """The small fields of a received ``Batch`` (repeated numbers as numpy arrays)."""
    return BatchMeta(**{f.name: _from_wire(f.name, getattr(message, f.name)) for f in dataclasses.fields(BatchMeta)})
