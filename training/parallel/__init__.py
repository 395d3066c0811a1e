"""Ranks and layouts: the process group and its collectives (distributed.py), one failing rank stopping them all
(failure.py), the `deepspeed` launcher as users run it (launch.py), DeepSpeed's C++ op builds (op_builds.py),
pipeline (pipeline.py), sequence (sequence_parallel.py), tensor (tensor_parallel.py) and expert (expert_parallel.py)
parallelism, what each feature runs with in each layout (support.py: one table, one check), and the run's model
assembled with them (build.py). The Layout record is training/planning/layout.py."""
