"""The shard format, defined in one place: the on-disk layout, the manifest, the
writers (WebDataset tars, LMDB of Caffe Datums) and the one reader every consumer
(daemon, ``feeder verify``, benchmarks) goes through."""
