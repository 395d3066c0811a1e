"""What a run will cost before it starts: shapes, memory, FLOPs, precision, the run plan, its checks and report."""
