"""Turns an image folder tree into WebDataset / LMDB shards with a Parquet index and
a versioned manifest (``feeder shard``), and checks them (``feeder verify``)."""

from sharder.config import SampleDataConfig, ShardConfig
from sharder.sample_data import make_sample_data
from sharder.shard import ShardReport, shard

__all__ = ["SampleDataConfig", "ShardConfig", "ShardReport", "make_sample_data", "shard"]
