"""Ranks and layouts: the process group, failures, pipeline, sequence and tensor parallelism."""
