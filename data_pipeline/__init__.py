"""Turn a recipe's `data:` section into training-ready packed rows. Never imports DeepSpeed.

config.py is the section's schema. prepare.py runs the stage: sources.py loads the documents (files.py reads local
files, naming the line at fault), filters.py applies the quality filters, dedup.py drops exact and near duplicates,
tokenize.py gives token ids and labels (chat.py renders chat samples, preference.py dpo's pairs, prompts.py grpo's
prompts) and pack.py packs them into rows, which loader.py serves as deterministic global batches sharded across the
data-parallel ranks (curriculum.py: which rows, when data.phases changes the mixture over the run; length_warmup.py:
the first steps' rows cut shorter). stream.py does
the same on the fly, for data that does not fit on disk; scale.py as a datatrove job, for corpora one machine cannot
prepare, in the work folder of work_folder.py (ray_job.py: its stages on a Ray cluster)."""


def processes(num_proc: int) -> int | None:
    """`num_proc` for `datasets.map`: datasets 5 starts a process pool even for 1, which a datatrove
    worker (a daemon process) may not; None maps in this process."""
    return num_proc if num_proc > 1 else None
