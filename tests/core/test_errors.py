"""The one table from errors to gRPC status codes and CLI lines."""

from __future__ import annotations

import grpc
import pytest

from core.errors import (
    ConfigError,
    DataError,
    FeederError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceUnavailable,
    Unauthenticated,
    cli_message,
    grpc_code,
)


@pytest.mark.parametrize("error,code,prefix", [
    (ConfigError("x"), grpc.StatusCode.FAILED_PRECONDITION, "error"),
    (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, "error"),
    (NotFound("x"), grpc.StatusCode.NOT_FOUND, "not found"),
    (DataError("x"), grpc.StatusCode.DATA_LOSS, "bad data"),
    (ServiceUnavailable("x"), grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, "over budget"),
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, "not authenticated"),
    (FeederError("x"), grpc.StatusCode.INTERNAL, "error"),
])
def test_each_error_has_one_code_and_one_line(error, code, prefix):
    assert grpc_code(error) == code
    assert cli_message(error) == f"feeder: {prefix}: x"
