"""Bad input through the command lines: exit code 2, a message that names the input and the fix, no
traceback, and nothing deleted. train.py, tools/compare_zero.py, `python -m data_pipeline` and
`python -m training export`, each through the main(argv) its command line calls (in-process: the checks run
before anything is launched); test_each_command_line_as_typed starts each one as a user types it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import data_pipeline.__main__ as data_cli
import train
from tests.conftest import REPO, SMALL_MODEL, TRAIN_ENV, main_in_process, run_train, save_small_checkpoint, snapshot
from tools import compare_zero
from training import __main__ as training_cli

MAINS = {"train.py": train.main, "tools/compare_zero.py": compare_zero.main, "data_pipeline": data_cli.main,
         "training": training_cli.main}


def start_command(*args: str) -> subprocess.CompletedProcess:
    """The command as a user types it: a process of its own."""
    return subprocess.run([sys.executable, *args], cwd=REPO, env=TRAIN_ENV, capture_output=True, text=True, timeout=300)


def run_command(*args: str) -> subprocess.CompletedProcess:
    """The command's main(argv) in this process (`-m package` and script paths as start_command takes them)."""
    program, argv = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    return main_in_process(MAINS[program], list(argv))


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert message in " ".join(result.stderr.split()), result.stderr[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_resume_with_overwrite_is_refused_and_the_checkpoints_survive(earlier_run):
    before = snapshot(earlier_run)
    result = run_command("train.py", "--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume",
                         "--overwrite", "training.max_steps=8")
    assert_refused(result, "--resume continues the run in the output folder and --overwrite replaces it: pass one")
    assert snapshot(earlier_run) == before


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "checkpoints/global_step4/run_state.json").write_text('{"step": 4, "tok'),
     "global_step4/run_state.json is damaged (not JSON)"),
    (lambda run: (run / "checkpoints/global_step4/run_state.json").write_text(
        '{"step": 4, "tokens_seen": 1, "world_size": 0, "zero_stage": "1", "precision": "fp32"}'),
     "run_state.json is damaged (world_size: Input should be greater than 0 (found 0); zero_stage: Input should be 0"),
    (lambda run: (run / "checkpoints/global_step4/run_state.json").write_text('[4]'),
     "run_state.json is damaged ((top level): Input should be a valid dictionary"),
    (lambda run: (run / "checkpoints/latest").write_text(""),
     "latest names '', not a complete checkpoint"),
    (lambda run: (run / "checkpoints/latest").write_bytes(b"\xff\xfeglobal\x00"),
     "not a complete checkpoint"),
], ids=["truncated run_state.json", "run_state.json of wrong types", "run_state.json a list", "empty latest",
        "garbage in latest"])
def test_a_damaged_checkpoint_names_the_file_and_the_earlier_checkpoint(earlier_run, damage, message):
    damage(earlier_run)
    before = snapshot(earlier_run)
    result = run_command("train.py", "--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume",
                         "training.max_steps=8")
    assert_refused(result, message)
    assert "to resume from the newest complete one before it: " in " ".join(result.stderr.split())
    assert "echo global_step" in result.stderr
    assert snapshot(earlier_run) == before


@pytest.mark.parametrize("args, message", [
    (["training.betas=[0.9,"], "override 'training.betas=[0.9,': the value is not valid YAML"),
    (["--dry-run", "--num-gpus", "0"], "argument --num-gpus: must be a whole number above 0, got '0'"),
    (["--dry-run", "--num-gpus", "-2", "--gpu-mem", "80"], "argument --num-gpus: must be a whole number above 0"),
    (["--dry-run", "--num-nodes", "0"], "argument --num-nodes: must be a whole number above 0"),
    (["--dry-run", "--num-nodes", "2"], "--num-nodes 2 plans for nodes of --num-gpus GPUs each: give --num-gpus"),
    (["--dry-run", "--num-gpus", "8", "--gpu-mem", "nan"], "argument --gpu-mem: must be a number above 0"),
    (["--resume", "training.max_steps=4"], "nothing is left to train"),
])
def test_train_py_refuses_bad_options(args, message, earlier_run):
    result = run_command("train.py", "--recipe", "tiny_llama", "--output-dir", str(earlier_run), *args)
    assert_refused(result, message)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("a file")
    result = run_command("train.py", "--recipe", "tiny_llama", "--output-dir", str(tmp_path / "taken" / "run"))
    assert_refused(result, f"{tmp_path / 'taken'} is a file, not a folder")


def test_weights_without_config_next_to_a_shipped_config_are_refused(tmp_path):
    save_small_checkpoint(tmp_path / "weights")
    (tmp_path / "weights" / "config.json").unlink()
    result = run_command("train.py", "--recipe", "tiny_llama", "--dry-run",
                         f"model.name_or_path={tmp_path / 'weights'}")
    assert_refused(result, "holds weights but no config.json, so they cannot be checked against model.config=")


@pytest.mark.parametrize("args, message", [
    (["training.betas=[0.9,"], "override 'training.betas=[0.9,': the value is not valid YAML"),
    (["--num-gpus", "0"], "argument --num-gpus: must be a whole number above 0"),
    (["--steps", "-1"], "argument --steps: must be a whole number above 0"),
    (["--stages", "2,3", "parallelism.pipeline_stages=2"], "every cell is refused by train.py's checks"),
])
def test_compare_zero_refuses_bad_input_before_any_launch(args, message, tmp_path):
    result = run_command("tools/compare_zero.py", "--recipe", "tiny_llama", "--output-dir", str(tmp_path / "out"),
                         *args)
    assert_refused(result, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["training.betas=[0.9,"], "override 'training.betas=[0.9,': the value is not valid YAML"),
    (["tokenizer.name_or_path=./no/such/tokenizer"], "tokenizer: cannot load a tokenizer from"),
])
def test_prepare_refuses_bad_input(args, message, tmp_path):
    result = run_command("-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "out"),
                         *args)
    assert_refused(result, message)


def test_prepare_loads_the_tokenizer_as_train_py_does(monkeypatch, tmp_path):
    """With the recipe's trust_remote_code, and through the same function (so the same pad token)."""
    import data_pipeline.__main__ as cli
    import training.models.model
    seen = []

    def load_tokenizer(name_or_path, trust_remote_code, cached_only=False):
        seen.append(trust_remote_code)
        raise training.models.model.ConfigError("stop here")

    monkeypatch.setattr(training.models.model, "load_tokenizer", load_tokenizer)
    assert cli.main(["prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "out"),
                     "model.trust_remote_code=true"]) == 2
    assert seen == [True]


@pytest.mark.parametrize("content, message", [
    (b'{"text": "one"}\n[1, 2]\n', "in.jsonl:2: a JSON list, not an object"),
    (b'{"text": "one"}\n"just a string"\n', "in.jsonl:2: a JSON str, not an object"),
    (b'{"text": "one"}\n{"text": "caf\xe9"}\n', "in.jsonl:2: not UTF-8"),
])
def test_dedup_names_the_bad_line(content, message, tmp_path):
    (tmp_path / "in.jsonl").write_bytes(content)
    result = run_command("-m", "data_pipeline", "dedup", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    assert_refused(result, message)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["{tmp}", "{tmp}/out.jsonl"], "a folder; pass a .jsonl file"),
    (["{tmp}/in.jsonl", "{tmp}/out.jsonl", "--num-proc", "0"], "argument --num-proc: must be a whole number above 0"),
    (["{tmp}/in.jsonl", "{tmp}/out.jsonl", "--threshold", "1.5"], "argument --threshold: must be a similarity above 0"),
    (["{tmp}/in.jsonl", "{tmp}/in.jsonl"], "is the input file; write the result to another file"),
    (["{tmp}/in.jsonl", "{tmp}/kept.jsonl"], "kept.jsonl already exists; choose another OUT, or pass --overwrite"),
    (["{tmp}/in.jsonl", "{tmp}/out.jsonl", "--num-perm", "100000"],
     "--num-perm 100000: Input should be less than or equal to 4096"),
], ids=["folder as input", "num-proc 0", "threshold above 1", "output over input", "existing output", "num-perm huge"])
def test_dedup_refuses_bad_arguments(args, message, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "one"}\n{"text": "one"}\n')
    (tmp_path / "kept.jsonl").write_text("an earlier result\n")
    result = run_command("-m", "data_pipeline", "dedup", *(arg.format(tmp=tmp_path) for arg in args))
    assert_refused(result, message)
    assert (tmp_path / "in.jsonl").read_text() == '{"text": "one"}\n{"text": "one"}\n'
    assert (tmp_path / "kept.jsonl").read_text() == "an earlier result\n" and not (tmp_path / "out.jsonl").exists()


def fake_tag(checkpoints: Path, run_state: bool = True, hf: bool = True) -> Path:
    tag = checkpoints / "global_step2"
    tag.mkdir(parents=True)
    (checkpoints / "latest").write_text("global_step2")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    if run_state:
        (tag / "run_state.json").write_text(json.dumps({"step": 2, "precision": "fp32"}))
    if hf:
        (tag / "hf").mkdir()
        (tag / "hf" / "config.json").write_text("{}")
    return tag


@pytest.mark.parametrize("kind, message", [
    ("plain DeepSpeed", "has no run_state.json: it was not written by train.py. For a DeepSpeed ZeRO checkpoint use "
                        "DeepSpeed's converter, python"),
    ("no hf", "global_step2/hf has no config.json"),
    ("existing output", "already exists; choose another OUT_DIR, or pass --overwrite to replace an earlier output of"),
])
def test_export_refuses_what_it_cannot_export(kind, message, tmp_path):
    fake_tag(tmp_path / "checkpoints", run_state=kind != "plain DeepSpeed", hf=kind != "no hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    out = tmp_path / ("out" if kind == "existing output" else "new")
    result = run_command("-m", "training", "export", str(tmp_path / "checkpoints"), str(out))
    assert_refused(result, message)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["train.py", "--recipe", "tiny_llama"], ["tools/compare_zero.py", "--recipe",
                                     "tiny_llama"], ["-m", "data_pipeline", "prepare", "--recipe", "tiny_llama"]])
def test_each_command_line_as_typed_exits_2_without_a_traceback(command, tmp_path):
    """The tests above call each command's main(argv); here the command itself runs, so its exit code and message
    are the process's (dedup's: tests/data_pipeline/test_bad_data.py; export's: the test below)."""
    result = start_command(*command, "--output-dir" if "prepare" not in command else "--output", str(tmp_path / "out"),
                           "training.betas=[0.9,")
    assert_refused(result, "override 'training.betas=[0.9,': the value is not valid YAML")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_overwrite_replaces_only_an_earlier_export(tmp_path, data_cache, tree_guard):
    result = run_train(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run"), SMALL_MODEL, data_cache,
                        "training.max_steps=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints, out, mine = str(tmp_path / "run" / "checkpoints"), tmp_path / "export", tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # a folder the user made, looking like a model
    with tree_guard():  # the first as a process of its own (the command as typed), the others in-process
        assert_refused(start_command("-m", "training", "export", checkpoints, str(mine), "--overwrite"),
                       "--overwrite replaces only an earlier output of python -m training export")
        for inside_the_input in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "out"):
            assert_refused(run_command("-m", "training", "export", checkpoints, str(inside_the_input), "--overwrite"),
                           "which this command reads: an output never")
    assert run_command("-m", "training", "export", checkpoints, str(out)).returncode == 0
    (out / "MY_MODEL_CARD.md").write_text("the user's")  # a file the export did not write: kept, and named
    with tree_guard(out):
        result = run_command("-m", "training", "export", checkpoints, str(out), "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "MY_MODEL_CARD.md").read_text() == "the user's" and (out / "model.safetensors").is_file()
    assert "kept 1 file that python -m training export did not write: MY_MODEL_CARD.md" in result.stdout
    assert not list(tmp_path.glob(".export.partial*"))
