"""Benchmark scores of an exported model with lm-evaluation-harness (its Hugging Face model class): `python -m training
evaluate RUN_OR_HF_DIR --tasks ...`, and `eval.benchmarks` at the end of a run.

A task named as a folder of eval_tasks/ is the one shipped here (it needs no network); any other name is one of
lm-eval's own, whose data comes from the hub. Results go to a `benchmarks/` folder: lm-eval's results.json and its
table (results.md); a run's summary.json gets the scores under `benchmarks` ({task: {metric: value}}).

`--num-processes N` runs the command again in N processes under accelerate's launcher, lm-eval's data-parallel
way: each process loads the model and scores its share of the requests, and rank 0 gathers and writes the results."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from training.base.errors import ConfigError
from training.base.output_guard import check_output, staged_folder, write_atomically
from training.base.strict_json import dumps
from training.compat.lm_eval import split_over_processes
from training.config.recipe import Recipe
from training.loop.metrics import MetricsLogger
from training.parallel.distributed import patient_barrier
from training.planning.plan import RunPlan
from training.state.checkpoint import restore_rng_states, rng_states
from training.state.export import export_tag

REPO = Path(__file__).resolve().parent.parent.parent
SHIPPED = REPO / "eval_tasks"
COMMAND = "python -m training evaluate"


def task_config(name: str) -> str | dict:
    """A shipped task's lm-eval config, its data files made absolute; another name as lm-eval knows it."""
    folder = SHIPPED / name
    if not (folder / "task.yaml").exists():
        return name
    config = yaml.safe_load((folder / "task.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(folder / path) for split, path in files.items()}
    return config


def run_tasks(hf_dir: Path, tasks: list[str], batch_size: int, limit: int | None) -> dict | None:
    """lm-eval's simple_evaluate on the folder's model, on this process's GPU (fp32 on a CPU). Under a launch of
    several processes (accelerate's, or a training run's ranks) each scores its share of the requests and only rank 0
    gets the results; the others get None."""
    import lm_eval
    from accelerate import PartialState
    from lm_eval.models.huggingface import HFLM

    cuda = torch.cuda.is_available()  # the task names were checked before (check_tasks)
    device = "cuda" if cuda else "cpu"
    if not cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # launched without a GPU, where accelerate would leave each process alone: this state, which HFLM's
        # Accelerator() shares, makes them one group of CPU processes on gloo
        PartialState(cpu=True)
    model = HFLM(pretrained=str(hf_dir), dtype="auto" if cuda else "float32", batch_size=batch_size, device=device)
    split_over_processes(model)
    return lm_eval.simple_evaluate(model=model, tasks=[task_config(task) for task in tasks], batch_size=batch_size,
                                   limit=limit, device=device, log_samples=False)


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results ('acc,none' -> 'acc'), without the standard errors."""
    return {task: {metric.split(",")[0]: value for metric, value in values.items()
                   if "," in metric and "_stderr" not in metric and isinstance(value, (int, float))}
            for task, values in results["results"].items()}


def check_tasks(tasks: list[str]) -> None:
    """Before anything is built: each task is shipped here or one lm-eval knows (its index takes seconds to build)."""
    unknown = [task for task in tasks if not (SHIPPED / task / "task.yaml").exists()]
    if not unknown:
        return
    from lm_eval.tasks import TaskManager

    unknown = [task for task in unknown if task not in TaskManager().all_tasks]
    if unknown:
        raise ConfigError(f"benchmark task(s) {', '.join(unknown)}: neither shipped here (eval_tasks/: "
                          f"{', '.join(sorted(p.name for p in SHIPPED.iterdir()))}) nor known to lm-eval "
                          f"(`lm-eval ls tasks` lists them)")


def check_benchmarks(recipe: Recipe) -> None:
    """eval.benchmarks, before anything is built: known tasks, and an hf/ export to run them on."""
    if recipe.eval.benchmarks and recipe.lora.enabled and not recipe.export.merge:
        raise ConfigError("eval.benchmarks runs on the run's hf/ export, which a LoRA run writes only with "
                          "export.merge: true; set it, or evaluate the adapter's merged export later")
    check_tasks(recipe.eval.benchmarks)


def benchmark_run(plan: RunPlan) -> dict | None:
    """eval.benchmarks on the finished run's hf/, every rank scoring its share of the requests (lm-eval's data
    parallelism over the run's process group); rank 0 writes <output>/benchmarks and returns the scores, the other
    ranks None."""
    evaluation = plan.recipe.eval
    if not evaluation.benchmarks:
        return None
    hf_dir, output_dir = plan.output_dir / "hf", plan.output_dir / "benchmarks"
    check_output(output_dir, COMMAND, [hf_dir], overwrite=True, option="--output-dir")  # a resumed run's earlier scores
    found = benchmark(hf_dir, evaluation.benchmarks, output_dir, evaluation.batch_size, evaluation.limit)
    return found


def benchmark_checkpoint(plan: RunPlan, step: int, logger: MetricsLogger) -> None:
    """eval.benchmark_checkpoints, every rank calling after a periodic checkpoint's save: rank 0 exports the checkpoint
    into a folder of its own inside it, every rank scores its share, rank 0 writes the results into the checkpoint's
    benchmarks/ and logs the scores at the step (metrics.jsonl, TensorBoard, trackers); the export is removed.
    lm-eval seeds the random generators: training goes on with its own states, as a resume from the checkpoint would."""
    evaluation = plan.recipe.eval
    if not evaluation.benchmark_checkpoints:
        return
    tag_dir = plan.output_dir / "checkpoints" / f"global_step{step}"
    model_dir, states = tag_dir / "benchmarked_model", rng_states()
    if dist.get_rank() == 0:
        export_tag(tag_dir.parent, tag_dir.name, model_dir)
    patient_barrier()
    found = benchmark(model_dir, evaluation.benchmarks, tag_dir / "benchmarks", evaluation.batch_size,
                      evaluation.limit)
    restore_rng_states(states)
    patient_barrier()  # every rank has its scores (in its own time): the model folder can go
    if dist.get_rank() == 0:
        shutil.rmtree(model_dir)
    logger.benchmarks(step, found)


def benchmark(hf_dir: Path, tasks: list[str], output_dir: Path, batch_size: int = 8,
              limit: int | None = None) -> dict[str, dict[str, float]] | None:
    """lm-eval's results.json and table (results.md) in output_dir, checked before (check_output); the scores. Under a
    launch of several processes only rank 0 writes them; the others return None."""
    from lm_eval.utils import make_table

    results = run_tasks(hf_dir, tasks, batch_size, limit)
    if results is None:
        return None
    with staged_folder(output_dir, COMMAND) as staging:
        (staging / "results.json").write_text(dumps(results, indent=2, default=str) + "\n")
        (staging / "results.md").write_text(make_table(results) + "\n")
    print(make_table(results))
    return scores(results)


def check_evaluation(target: Path, tasks: list[str], output_dir: Path | None, overwrite: bool) -> tuple[Path, Path]:
    """`python -m training evaluate`'s checks, before any model loads or process starts: (the model folder, the
    results folder)."""
    run = is_run(target)
    if not run and (target / "summary.json").exists() and (target / "adapter").is_dir():
        raise ConfigError(f"{target} is a LoRA run without a merged model: its adapter/ holds the adapters alone. "
                          f"Train with export.merge=true to have hf/ (the adapters merged into the base weights) and "
                          f"evaluate the run, or merge adapter/ into its base with peft (PeftModel.from_pretrained("
                          f"base, adapter).merge_and_unload().save_pretrained(DIR)) and evaluate DIR with --output-dir")
    if not run and not (target / "config.json").exists():
        raise ConfigError(f"{target} is neither a run folder (hf/ and summary.json) nor a Hugging Face model folder "
                          f"(config.json)")
    if output_dir is None and not run:
        raise ConfigError(f"{target} is a model folder, not a run: give --output-dir for the results")
    check_tasks(tasks)
    hf_dir, output_dir = (target / "hf" if run else target), output_dir or target / "benchmarks"
    check_output(output_dir, COMMAND, [hf_dir], overwrite, option="--output-dir")
    return hf_dir, output_dir


def is_run(target: Path) -> bool:
    return (target / "hf" / "config.json").exists() and (target / "summary.json").exists()


def evaluate_folder(target: Path, tasks: list[str], output_dir: Path | None, overwrite: bool, batch_size: int = 8,
                    limit: int | None = None) -> dict[str, dict[str, float]] | None:
    """`python -m training evaluate` in this process (one of several under a launch: only rank 0 writes, the others
    return None): a run folder (its hf/ export; results in its benchmarks/, scores added to its summary.json) or a
    Hugging Face folder (results in output_dir)."""
    hf_dir, output_dir = check_evaluation(target, tasks, output_dir, overwrite)
    found = benchmark(hf_dir, tasks, output_dir, batch_size, limit)
    if found is not None and is_run(target):
        summary = json.loads((target / "summary.json").read_text())
        summary["benchmarks"] = {**summary.get("benchmarks", {}), **found}
        write_atomically(target / "summary.json", dumps(summary, indent=2) + "\n")
    return found


def evaluate_in_processes(num_processes: int, argv: list[str]) -> int:
    """`python -m training evaluate` (its arguments: argv) again in num_processes processes under accelerate's launcher:
    one per GPU, or CPU processes where there is no GPU (run_tasks groups them on gloo). The launcher's exit code; the
    caller has run check_evaluation."""
    gpus = torch.cuda.device_count()
    if gpus and num_processes > gpus:
        raise ConfigError(f"--num-processes {num_processes}: this machine has {gpus} GPU(s) and each process takes "
                          f"one; give at most {gpus}")
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // num_processes))  # cores each
    # --multi_gpu is accelerate's torchrun launch, also on a CPU machine (its --cpu starts one process, or needs MPI)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", "--num_cpu_threads_per_process", threads, "-m", "training", *argv]
    return subprocess.run(command).returncode
