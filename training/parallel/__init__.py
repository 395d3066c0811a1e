"""Ranks and layouts: the process group, failures, the launcher, the Layout record, pipeline, sequence and tensor
parallelism."""
