"""The S3 server of the tests and benchmarks: it answers on the ports it chose, with
the identity it was given, and refuses another."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyarrow import fs as pafs

from bench.seaweedfs import SeaweedFS, SeaweedPorts, free_ports, weed_binary
from tests.common.s3 import fresh_bucket


def test_the_weed_binary_is_installed() -> None:
    assert weed_binary().is_file()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)
    assert len(SeaweedPorts.pick().arguments()) == 8


def test_it_serves_objects_with_its_identity(s3_server: SeaweedFS) -> None:
    bucket = fresh_bucket(s3_server)
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{bucket}/a/b.bin") as out:
        out.write(b"0123456789")
    with fs.open_input_file(f"{bucket}/a/b.bin") as back:
        assert back.read_at(4, 3) == b"3456"
    assert s3_server.endpoint_url == f"http://{s3_server.endpoint}"
    assert (Path(s3_server.data_dir) / "store").is_dir()


def test_a_wrong_secret_is_refused(s3_server: SeaweedFS) -> None:
    bucket = fresh_bucket(s3_server)
    with s3_server.filesystem().open_output_stream(f"{bucket}/x") as out:
        out.write(b"x")
    wrong = pafs.S3FileSystem(access_key=s3_server.access_key, secret_key="not-the-secret", region=s3_server.region,
                              endpoint_override=s3_server.endpoint, scheme="http")
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        wrong.open_input_file(f"{bucket}/x")
