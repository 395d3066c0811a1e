"""The datatrove job's work folder, OUTPUT.datatrove beside the output: its layout, who owns it, and what a
rerun continues from. It follows the rules of every output (training/base/output_guard.py), with job.json as the
job's mark: a rerun of the same job continues it, anything else leaves it alone."""
import json
from dataclasses import dataclass
from pathlib import Path

from training.base.errors import DataError
from training.base.output_guard import overlap
from training.base.strict_json import dumps

JOB_KEYS = {"fingerprint": "data section, source files or tokenizer", "tasks": "--tasks",
            "stages": "version of the stages (an earlier checkout of this repository)"}


@dataclass(frozen=True)
class Layout:
    """The job's folders (OUTPUT.datatrove): each stage's files and datatrove's logs."""
    root: Path

    def __call__(self, name: str) -> str:
        return str(self.root / name)

    def logs(self, stage: str) -> str:
        return str(self.root / "logs" / stage)


def work_folder(output: Path) -> Path:
    """Where the job keeps its files: OUTPUT.datatrove, beside the output."""
    return output.with_name(f"{output.name}.datatrove")


def check_work_folder(work: Path, inputs: list[Path]) -> None:
    """Before any work: the folder holds no input and lies inside none, and an existing one is a job's (its job.json;
    claim_work_folder checks that it is this job's)."""
    if found := overlap(work, inputs):
        how, source = found
        raise DataError(f"the job's work folder {work} {how} {source}, which the recipe reads: an output never holds "
                        f"or goes inside an input; choose another --output (nothing was written)")
    if (work.exists() or work.is_symlink()) and not (work / "job.json").is_file():
        raise DataError(f"{work} exists and holds no job.json, so no prepare job started it; the job would write its "
                        f"files there: move it away or choose another --output (nothing was written)")


def claim_work_folder(work: Layout, job: dict) -> None:
    """The job's folder holds the tasks already done. A rerun continues them only for the same data
    section, tokenizer and task count; anything else would mix two jobs' files."""
    marker = Path(work.root, "job.json")
    if marker.exists():
        started = json.loads(marker.read_text())
        if started != job:
            changed = " and ".join(JOB_KEYS[k] for k in job if started.get(k) != job[k])
            raise DataError(f"{work.root} holds a job started with another {changed}; rerun with the same recipe "
                            f"and --tasks to finish it, or remove {work.root} to start over")
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(dumps(job, indent=2) + "\n")


def job_fingerprint(work: Layout) -> str:
    """The fingerprint claim_work_folder recorded (prepare.fingerprint of the data section, files and tokenizer). The
    tasks' rows and the eval split are saved with fingerprints that start with it, as the in-process path's splits
    are, so two jobs' splits never share one (the linked train split's is a hash of its parts')."""
    return json.loads(Path(work.root, "job.json").read_text())["fingerprint"]


def missing_files(work: Layout, held_out: bool) -> list[Path]:
    """The files a rerun needs that finished tasks wrote and that are gone: each finished `rows` task's rows, counts
    and step counters, and, once assemble had finished (so there were some), the held-out evaluation documents."""
    from training.compat.datatrove import completed_tasks  # here: the datasets engine runs without datatrove
    needed = []
    for rank in completed_tasks(work.logs("rows")):
        counts = Path(work("rows"), f"train-{rank}.json")
        needed += [counts, Path(work.logs("rows"), "stats", f"{rank}.json")]
        if counts.exists() and json.loads(counts.read_text()).get("rows", 0):
            needed.append(counts.with_suffix(""))  # the task's saved rows
    missing = [path for path in needed if not path.exists()]
    if held_out and assembled(work) and not any(Path(work("eval_documents")).glob("*.jsonl*")):
        missing.append(Path(work("eval_documents")))
    return missing


def assembled(work: Layout) -> Path | None:
    """datatrove's marker of the finished assemble stage, when it is there."""
    from training.compat.datatrove import completion_marker
    marker = completion_marker(work.logs("assemble"), 0)
    return marker if marker.exists() else None


def reopen_for_rerun(work: Layout, output: Path, held_out: bool) -> None:
    """A rerun with the output missing. If datatrove marked assemble complete, the finished job's output was deleted
    since, and datatrove would skip every task: assemble runs again from the rows the job kept, its completion
    marker (a file this job wrote) cleared. When files of finished tasks are gone too, no rerun redoes those tasks:
    refuse, naming what to delete. `held_out`: the job holds out evaluation documents (eval.fraction)."""
    if output.exists():
        return
    if missing := missing_files(work, held_out):
        raise DataError(f"{output} is not there and the job's files of finished tasks are gone too ("
                        f"{', '.join(map(str, missing[:3]))}{', ...' if len(missing) > 3 else ''}): datatrove would "
                        f"skip those tasks; remove {work.root} to run the job again from the start")
    if marker := assembled(work):
        marker.unlink()
