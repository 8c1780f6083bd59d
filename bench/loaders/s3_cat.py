"""``python -m bench.loaders.s3_cat s3://bucket/key``: the object's bytes on stdout.

The small reader behind the ``webdataset-s3`` loader's ``pipe:`` URLs (WebDataset's
documented way to read from a store: a command that writes the shard to stdout, e.g.
``pipe:aws s3 cp URL -``), with boto3 streaming the body in 1 MiB chunks. The endpoint
and credentials are the standard AWS variables (``AWS_ENDPOINT_URL`` and the keys).
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_CHUNK_BYTES = 1 << 20


def main(argv: list[str]) -> int:
    """Copies the object ``argv[0]`` to stdout; returns 0, or 2 with one line on a bad URL."""
    if len(argv) != 1 or not argv[0].startswith("s3://") or "/" not in argv[0][5:]:
        print("s3_cat: give one s3://bucket/key URL", file=sys.stderr)
        return 2
    import boto3

    bucket, _, key = argv[0][5:].partition("/")
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    out = sys.stdout.buffer
    for chunk in body.iter_chunks(_CHUNK_BYTES):
        out.write(chunk)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
