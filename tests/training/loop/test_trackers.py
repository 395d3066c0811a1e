"""logging.report_to: W&B (offline) and MLflow (a local file store) get what metrics.jsonl gets, read back from what
they wrote; a resumed run continues the same tracker runs; a missing package stops the run before anything is
built, and a tracker that fails mid-run costs a warning, not the run."""
import json
import time
from types import SimpleNamespace

import mlflow
import pytest

import train
from tests.conftest import SMALL_MODEL, train_in_process
from training.base.errors import ConfigError
from training.compat.wandb import read_offline_run
from training.loop.trackers import Trackers, flat
from training.parallel.launch import free_port

TRACKED = "logging.report_to=[tensorboard, wandb, mlflow]"


def step_records(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def wandb_history(out) -> tuple[set[str], dict[int, dict], list[dict]]:
    """Every offline run file's run id, and the history of them all by step (a resume writes a second file)."""
    runs = [read_offline_run(path) for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))]
    return {run["id"] for run in runs}, {row["_step"]: row for run in runs for row in run["history"]}, runs


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, data_cache):
    """Two steps, then a resume to four in another layout (ZeRO-3, through a universal conversion), with every
    tracker on and W&B offline."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    patch = pytest.MonkeyPatch()
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    patch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        common = ["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache, TRACKED,
                  "logging.every_steps=1", "checkpointing.every_steps=2", "logging.project=tests"]
        for args in (["training.max_steps=2"], ["--resume", "training.max_steps=4", "deepspeed.config=zero3"]):
            result = train_in_process([*common, *args])
            assert result.returncode == 0, result.stderr[-3000:]
    finally:
        patch.undo()
    return out


@pytest.mark.slow
def test_wandb_and_mlflow_get_what_metrics_jsonl_gets(tracked_run, tmp_path):
    records = step_records(tracked_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    ids, history, runs = wandb_history(tracked_run)
    assert len(runs) == 2 and len(ids) == 1, "the resumed run started another W&B run"
    client = mlflow.MlflowClient((tracked_run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tests")
    mlflow_run, = client.search_runs([experiment.experiment_id])
    for record in records:
        for name, value in flat(record).items():
            assert history[record["step"]][name] == pytest.approx(value, rel=1e-12), (record["step"], name)
            logged = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, name)}
            assert logged[record["step"]] == pytest.approx(value, rel=1e-12), (record["step"], name)
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(flat(records[-1]))
    summary = json.loads((tracked_run / "summary.json").read_text())
    assert runs[-1]["summary"]["final_loss"] == pytest.approx(summary["final_loss"])
    assert mlflow_run.info.status == "FINISHED"
    saved = client.download_artifacts(mlflow_run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(open(saved).read()) == summary
    recipe = client.download_artifacts(mlflow_run.info.run_id, "resolved_recipe.json", str(tmp_path))
    assert json.loads(open(recipe).read())["logging"]["project"] == "tests"


@pytest.mark.slow
def test_the_trackers_get_the_recipe_the_ds_config_and_the_run_ids_resume_from(tracked_run):
    _, _, runs = wandb_history(tracked_run)
    assert runs[0]["config"]["recipe"]["logging"]["report_to"] == ["tensorboard", "wandb", "mlflow"]
    assert runs[-1]["config"]["ds_config"] == json.loads((tracked_run / "ds_config.json").read_text())
    assert [run["config"]["ds_config"]["zero_optimization"]["stage"] for run in runs] == [1, 3]  # the resume's own
    assert (runs[0]["project"], runs[0]["name"]) == ("tests", "run")
    state = json.loads(next(tracked_run.glob("checkpoints/global_step4/*.json")).read_text())
    assert state["trackers"]["wandb"] == runs[0]["id"] and len(state["trackers"]["mlflow"]) == 32
    assert (tracked_run / "tensorboard").is_dir()


def test_a_tracker_that_is_not_installed_stops_the_run_before_anything_is_built(monkeypatch):
    import training.loop.trackers as trackers
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"names wandb, which is not installed: pip install wandb==0\.31\.0"):
        train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run", "logging.report_to=[wandb]"]))


def test_the_old_tensorboard_key_says_what_replaced_it():
    result = train_in_process(["--recipe", "tiny_llama", "--dry-run", "logging.tensorboard=true"])
    assert result.returncode == 2 and "logging.tensorboard is now one of logging.report_to's trackers" in result.stderr


def test_summaries_reach_the_trackers_as_scalars_benchmark_scores_included():
    summary = {"final_loss": 2.5, "steps": 4, "device": "cpu", "data": {"rows": 3}, "stability": {"skip": 0},
               "benchmarks": {"python_docs_mc": {"acc": 0.25, "acc_norm": 0.24}}}
    assert flat(summary) == {"final_loss": 2.5, "steps": 4, "benchmarks/python_docs_mc/acc": 0.25,
                             "benchmarks/python_docs_mc/acc_norm": 0.24}


class Failing:
    id = "x"

    def log(self, scalars, step):
        raise ConnectionError("server went away")


class Kept:
    id, logged = "y", []

    def log(self, scalars, step):
        self.logged.append((step, scalars))


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(capsys):
    trackers = Trackers.__new__(Trackers)
    trackers.active = {"mlflow": Failing(), "wandb": Kept()}
    trackers.log({"step": 3, "loss": 2.0})
    trackers.log({"step": 4, "loss": 1.5})
    assert list(trackers.active) == ["wandb"] and Kept.logged == [(3, {"loss": 2.0}), (4, {"loss": 1.5})]
    assert capsys.readouterr().err.count("warning: logging.report_to: mlflow failed (ConnectionError") == 1


def test_an_mlflow_server_that_does_not_answer_is_named_within_seconds(monkeypatch):
    """MLflow's client retries an unreachable server for minutes in silence (261 s seen): the port is tried first."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    plan = SimpleNamespace(recipe=SimpleNamespace(model_dump=lambda mode: {},
                                                  logging=SimpleNamespace(report_to=["mlflow"])), ds_config={})
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"mlflow could not start a run: ConnectionError: MLFLOW_TRACKING_URI "
                                          r"http://127.0.0.1:\d+: nothing answers at 127.0.0.1:\d+ within 5 s"):
        Trackers(plan, {}, True)
    assert time.monotonic() - started < 30
