"""Benchmark scores of an exported model with lm-evaluation-harness (its Hugging Face model class): `python -m training
evaluate RUN_OR_HF_DIR --tasks ...`, and `eval.benchmarks` at the end of a run.

A task named as a folder of eval_tasks/ is the one shipped here (it needs no network); any other name is one of
lm-eval's own, whose data comes from the hub. Results go to a `benchmarks/` folder: lm-eval's results.json and its
table (results.md); a run's summary.json gets the scores under `benchmarks` ({task: {metric: value}})."""
import json
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from training.config.errors import ConfigError
from training.config.recipe import Recipe
from training.planning.plan import RunPlan
from training.state.output_guard import check_output, staged_folder, write_atomically

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


def run_tasks(hf_dir: Path, tasks: list[str], batch_size: int, limit: int | None) -> dict:
    """lm-eval's simple_evaluate on the folder's model, on this process's GPU (fp32 on a CPU)."""
    import lm_eval

    cuda = torch.cuda.is_available()  # the task names were checked before (check_tasks)
    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "auto" if cuda else "float32"},
                                   tasks=[task_config(task) for task in tasks], batch_size=batch_size, limit=limit,
                                   device="cuda" if cuda else "cpu", log_samples=False)


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


def benchmark_run(plan: RunPlan) -> dict:
    """eval.benchmarks on the finished run's hf/, by rank 0 into <output>/benchmarks: {"benchmarks": scores}."""
    evaluation = plan.recipe.eval
    if not evaluation.benchmarks or dist.get_rank() != 0:
        return {}
    return {"benchmarks": benchmark(plan.output_dir / "hf", evaluation.benchmarks, plan.output_dir / "benchmarks",
                                    batch_size=evaluation.batch_size, limit=evaluation.limit)}


def benchmark(hf_dir: Path, tasks: list[str], output_dir: Path, overwrite: bool = False, batch_size: int = 8,
              limit: int | None = None) -> dict[str, dict[str, float]]:
    """lm-eval's results.json and table (results.md) in output_dir (replacing only an earlier evaluate output); the
    scores."""
    from lm_eval.utils import make_table

    check_output(output_dir, COMMAND, [hf_dir], overwrite, option="--output-dir")
    results = run_tasks(hf_dir, tasks, batch_size, limit)
    with staged_folder(output_dir, COMMAND) as staging:
        (staging / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (staging / "results.md").write_text(make_table(results) + "\n")
    print(make_table(results))
    return scores(results)


def evaluate_folder(target: Path, tasks: list[str], output_dir: Path | None, overwrite: bool, batch_size: int = 8,
                    limit: int | None = None) -> dict[str, dict[str, float]]:
    """`python -m training evaluate`: a run folder (its hf/ export; results in its benchmarks/, scores added to its
    summary.json) or a Hugging Face folder (results in output_dir)."""
    run = (target / "hf" / "config.json").exists() and (target / "summary.json").exists()
    if not run and not (target / "config.json").exists():
        raise ConfigError(f"{target} is neither a run folder (hf/ and summary.json) nor a Hugging Face model folder "
                          f"(config.json)")
    if output_dir is None and not run:
        raise ConfigError(f"{target} is a model folder, not a run: give --output-dir for the results")
    check_tasks(tasks)
    found = benchmark(target / "hf" if run else target, tasks, output_dir or target / "benchmarks", overwrite,
                      batch_size, limit)
    if run:
        summary = json.loads((target / "summary.json").read_text())
        summary["benchmarks"] = {**summary.get("benchmarks", {}), **found}
        write_atomically(target / "summary.json", json.dumps(summary, indent=2) + "\n")
    return found
