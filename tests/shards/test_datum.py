"""shards.datum: hand-encoded Caffe Datum messages, checked against protobuf itself."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from shards.datum import decode_datum, encode_datum


def _datum_class():
    """Build caffe.Datum at run time from its field list (caffe.proto) with protobuf."""
    proto = descriptor_pb2.FileDescriptorProto(name="caffe_datum_test.proto", package="caffe", syntax="proto2")
    message = proto.message_type.add(name="Datum")
    f = descriptor_pb2.FieldDescriptorProto
    fields = [("channels", 1, f.TYPE_INT32), ("height", 2, f.TYPE_INT32), ("width", 3, f.TYPE_INT32),
              ("data", 4, f.TYPE_BYTES), ("label", 5, f.TYPE_INT32), ("encoded", 7, f.TYPE_BOOL)]  # fmt: skip
    for name, number, kind in fields:
        message.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


def test_protobuf_parses_the_hand_encoding() -> None:
    payload = bytes(range(256)) * 3
    datum = _datum_class().FromString(encode_datum(payload, 917, width=500, height=375))
    fields = (datum.data, datum.label, datum.width, datum.height, datum.channels, datum.encoded)
    assert fields == (payload, 917, 500, 375, 3, True)


def test_decode_round_trip() -> None:
    fields = decode_datum(encode_datum(b"\xff\xd8jpeg", 0, width=1, height=2))
    assert fields == {1: 3, 2: 2, 3: 1, 4: b"\xff\xd8jpeg", 5: 0, 7: 1}
