"""Leaf modules every other package may import: the error hierarchy, the
command line's error handling, protobuf wire helpers and logging set-up. Nothing here
imports another package of the project."""
