"""W&B and MLflow beside metrics.jsonl (`logging.report_to`), from rank 0 only.

Each tracker gets what metrics.jsonl gets, under the same names and steps (`expert_tokens` as one number per layer
and expert, `experts/layerLL/expertEE`, as TensorBoard has them), each stability event as `events/<kind>` = 1 at
its step, the resolved recipe and DeepSpeed config as the run's config, and summary.json at the end. Its run id
goes into every checkpoint's run state, so a resumed run continues the same tracker run.

Offline: W&B writes under <output>/wandb when WANDB_MODE=offline (`wandb sync` uploads it later), the whole file by
the time Trackers.finish returns (W&B's own finish returns before its service writes it: training/compat/wandb.py);
MLflow writes a local file store, <output>/mlruns, unless MLFLOW_TRACKING_URI names a server. A tracker that cannot
start is a user error (exit 2, before training); one that fails mid-run is a warning, once, and training goes on
without it.
"""
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from training.base.errors import ConfigError
from training.compat.wandb import finished_run_records
from training.planning.plan import RunPlan

PACKAGES = {"wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.17.2"}  # requirements.txt's pins


def check_trackers(report_to: list[str]) -> None:
    """Before anything is built: every tracker named is installed."""
    for name in report_to:
        if name in PACKAGES and importlib.util.find_spec(name) is None:
            raise ConfigError(f"logging.report_to names {name}, which is not installed: pip install "
                              f"{PACKAGES[name]} (requirements.txt), or leave {name} out of logging.report_to")


def flat(record: dict) -> dict[str, float]:
    """A metrics.jsonl record (or summary.json) as scalars: expert_tokens one per layer and expert, benchmark scores
    one per task and metric, source_tokens one per source, the other numbers as named."""
    scalars = {}
    for key, value in record.items():
        if key == "expert_tokens":
            scalars.update({f"experts/layer{layer:02d}/expert{expert:02d}": count
                            for layer, tokens in enumerate(value) for expert, count in enumerate(tokens)})
        elif key == "benchmarks":
            scalars.update({f"benchmarks/{task}/{metric}": score
                            for task, metrics in value.items() for metric, score in metrics.items()})
        elif key == "source_tokens":  # data.phases: each source's tokens so far
            scalars.update({f"data/source_tokens/{source}": count for source, count in value.items()})
        elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = value
    return scalars


class WandbRun:
    def __init__(self, plan: RunPlan, run_id: str | None, config: dict):
        import wandb

        logging = plan.recipe.logging
        self.run = wandb.init(project=logging.project or plan.recipe.name,
                              name=logging.run_name or plan.output_dir.name,
                              id=run_id, resume="allow" if run_id else None, dir=str(plan.output_dir), config=config)
        self.id = self.run.id
        self.offline_file = Path(self.run.settings.sync_file) if self.run.offline else None

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update(flat(summary))
        self.run.finish()
        if self.offline_file:  # finish() returns before W&B's service has written the file
            finished_run_records(self.offline_file)


def check_server(uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) tracking server's port answers within seconds: MLflow's client retries one that does not for
    minutes (about 4.5 with its defaults), saying nothing."""
    parts = urlparse(uri)
    if parts.scheme not in ("http", "https"):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConnectionError(f"MLFLOW_TRACKING_URI {uri}: nothing answers at {parts.hostname}:{port} within "
                              f"{timeout_s:.0f} s ({error})") from None


class MlflowRun:
    def __init__(self, plan: RunPlan, run_id: str | None, config: dict):
        import mlflow

        check_server(os.environ.get("MLFLOW_TRACKING_URI", ""))
        logging = plan.recipe.logging
        if "MLFLOW_TRACKING_URI" not in os.environ:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 asks for this opt-in to a file store
            mlflow.set_tracking_uri((plan.output_dir / "mlruns").resolve().as_uri())
        self.client = mlflow.MlflowClient()
        if run_id is None:
            experiment = logging.project or plan.recipe.name
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(experiment_id,
                                            run_name=logging.run_name or plan.output_dir.name).info.run_id
            self.client.log_dict(run_id, config["recipe"], "resolved_recipe.json")
            self.client.log_dict(run_id, config["ds_config"], "ds_config.json")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.id = run_id

    def log(self, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(name, float(value), now, step)
                                                for name, value in scalars.items()])

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.client.log_dict(self.id, summary, "summary.json")
        self.client.set_terminated(self.id, status="FINISHED" if summary is not None else "KILLED")


RUNS = {"wandb": WandbRun, "mlflow": MlflowRun}


class Trackers:
    """Rank 0's W&B and MLflow runs (none elsewhere, or when report_to names neither)."""

    def __init__(self, plan: RunPlan, ids: dict[str, str], enabled: bool):
        self.active = {}
        if not enabled:
            return
        config = {"recipe": plan.recipe.model_dump(mode="json"), "ds_config": plan.ds_config}
        for name in plan.recipe.logging.report_to:
            if name in RUNS:
                try:
                    self.active[name] = RUNS[name](plan, ids.get(name), config)
                except Exception as error:  # noqa: BLE001 (a tracker's own errors: no key, no server, ...)
                    raise ConfigError(f"logging.report_to: {name} could not start a run: {type(error).__name__}: "
                                      f"{error}. For no network: WANDB_MODE=offline (W&B), or leave "
                                      f"MLFLOW_TRACKING_URI unset for a local store under the output folder "
                                      f"(MLflow)") from error

    @property
    def ids(self) -> dict[str, str]:
        return {name: run.id for name, run in self.active.items()}

    def log(self, record: dict) -> None:
        self.call("log", flat(record), record["step"])

    def event(self, event: dict) -> None:
        self.call("log", {f"events/{event['event']}": 1}, event["step"])

    def finish(self, summary: dict | None) -> None:
        """summary.json's content at the end of a finished run; None for a run that stopped early."""
        self.call("finish", summary)
        self.active = {}

    def call(self, method: str, *args) -> None:
        for name, run in list(self.active.items()):
            try:
                getattr(run, method)(*args)
            except Exception as error:  # noqa: BLE001 (a tracker must never stop training)
                print(f"warning: logging.report_to: {name} failed ({type(error).__name__}: {error}); training goes "
                      f"on without it, metrics.jsonl has every record", file=sys.stderr, flush=True)
                del self.active[name]
