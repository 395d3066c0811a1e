"""tools/compare.py's checks, all made before anything is written or launched: each cell runs what its label says
(no key given twice, no value twice, no key that compare.py sets itself), each cell has a folder of its own, and the
output folder follows training/base/output_guard.py (the default takes the next free name; an existing one is replaced
only with --overwrite, and only when an earlier comparison wrote it). The fast tests stop where the first cell would
be launched; the slow one runs a real comparison twice."""
import csv
import shutil
import sys

import pytest

from tests.conftest import REPO, SMALL_MODEL
from training.base.output_guard import written_by
from training.config.recipe import load_recipe

sys.path.insert(0, str(REPO / "tools"))
import compare  # noqa: E402
import compare_zero  # noqa: E402

from tools import comparison_report  # noqa: E402

LR = "--vary", "training.lr=0.001,0.002"


class Launched(Exception):
    """Raised where the first cell would be launched: every check before it passed."""


@pytest.fixture
def no_launch(monkeypatch):
    def launched(args, cell, output_dir):
        raise Launched(output_dir)

    monkeypatch.setattr(compare, "run_cell", launched)


def refused(capsys, argv: list[str], message: str, main=compare.main) -> None:
    assert main(["--recipe", "tiny_llama", *argv]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert error.startswith("error: ") and message in error, error


@pytest.mark.parametrize("argv, message", [
    (["--vary", "training.lr=0.001,0.002", "--vary", "training.lr=0.003"],
     "training.lr is given in both --vary training.lr=0.001,0.002 and --vary training.lr=0.003: overrides apply in "
     "order (the fixed ones, then each --vary) and the last wins"),
    ([*LR, "training.lr=0.1"], "training.lr is given in both the override training.lr=0.1 and --vary training.lr="),
    (["--vary", "deepspeed.overrides={a: 1},{a: 2}", "deepspeed.overrides.b=1"],
     "--vary deepspeed.overrides={a: 1},{a: 2} sets deepspeed.overrides, which overlaps deepspeed.overrides.b from "
     "the override deepspeed.overrides.b=1"),
    (["--vary", "training.lr=0.001,0.001"], "--vary training.lr=0.001,0.001: training.lr=0.001 and training.lr=0.001 "
                                            "are the same value, which would run the same cell twice; give each value "
                                            "once"),
    (["--vary", "training.lr=0.001,0.0010"], "training.lr=0.001 and training.lr=0.0010 are the same value"),
    (["--vary", "training.lr=0.001,1e-3"], "the cells training.lr=0.001 and training.lr=1e-3 run the same recipe"),
    (["--vary", "training.max_steps=5,10"], "--vary training.max_steps=5,10 sets training.max_steps, which "
                                            "compare.py sets itself: every cell trains --steps (30) steps, "
                                            "training.max_steps=30 with training.epochs unset; pass --steps N instead"),
    ([*LR, "training.max_steps=5"], "the override training.max_steps=5 sets training.max_steps, which compare.py "
                                    "sets itself: every cell trains --steps (30) steps"),
    ([*LR, "training.epochs=2"], "the override training.epochs=2 sets training.epochs, which compare.py sets itself"),
    ([*LR, "logging.every_steps=5"], "the override logging.every_steps=5 sets logging.every_steps, which compare.py "
                                     "sets itself: it logs every step"),
    ([*LR, "logging={every_steps: 5}"], "sets logging.every_steps (logging.every_steps inside logging), which"),
], ids=["key in two --vary", "key varied and fixed", "parent replaces a child", "value twice", "value twice, "
        "written two ways", "one recipe twice", "max_steps varied", "max_steps fixed", "epochs fixed",
        "every_steps fixed", "every_steps inside a mapping"])
def test_a_cell_that_would_not_run_its_label_is_refused(argv, message, capsys, tmp_path, tree_guard, no_launch):
    with tree_guard():
        refused(capsys, [*argv, "--output-dir", str(tmp_path / "out")], message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--stages", "1,1"], "--stages 1,1: deepspeed.config=zero1 and deepspeed.config=zero1 are the same value"),
    (["deepspeed.config=zero2"], "deepspeed.config is given in both the override deepspeed.config=zero2 and "
                                 "--stages 0,1,2,3"),
])
def test_compare_zero_names_its_stages(argv, message, capsys, tmp_path, tree_guard, no_launch):
    with tree_guard():
        refused(capsys, [*argv, "--output-dir", str(tmp_path / "out")], message, main=compare_zero.main)


def test_a_recipe_that_counts_epochs_runs_steps(tmp_path, no_launch):
    """qwen2_5_1_5b trains training.epochs=1: each cell trains --steps steps instead (no key set twice)."""
    with pytest.raises(Launched):
        compare.main(["--recipe", "qwen2_5_1_5b", "--vary", "training.lr=0.001,0.002", "--steps", "3", "--output-dir",
                      str(tmp_path / "out")])


def test_a_varied_key_may_go_inside_a_fixed_mapping(tmp_path, no_launch):
    """A fixed mapping with a --vary of another key inside it loses nothing: both apply. The cell's recipe is read
    from the overrides train.py gets (cell_overrides), in their order: the mapping first, else it would replace the
    varied key."""
    argv = ["--recipe", "tiny_llama", "--vary", "logging.run_name=a,b", "logging={peak_tflops: 1}",
            "--output-dir", str(tmp_path / "out")]
    with pytest.raises(Launched):
        compare.main(argv)
    args = compare.parse_args(argv)
    cells = [load_recipe(args.recipe, compare.cell_overrides(args, cell)).logging for cell in args.cells]
    assert [(logging.run_name, logging.peak_tflops) for logging in cells] == [("a", 1), ("b", 1)]


def test_a_varied_value_keeps_the_commas_inside_its_brackets():
    """A list of mappings is one value (grpo.rewards' entries), nested as deep as it goes."""
    args = compare.parse_args(["--recipe", "tiny_llama_grpo", "--vary",
                               "grpo.rewards=[{function: a}, {function: b}],[{function: a}, {model: m, weight: 0.1}]",
                               "--vary", "training.betas=[0.9,0.95],[0.9,0.99]", "--vary", "data.seq_len=64,128"])
    assert args.varied == [["grpo.rewards=[{function: a}, {function: b}]",
                            "grpo.rewards=[{function: a}, {model: m, weight: 0.1}]"],
                           ["training.betas=[0.9,0.95]", "training.betas=[0.9,0.99]"],
                           ["data.seq_len=64", "data.seq_len=128"]]


def test_cells_get_folders_of_their_own():
    """Values that differ only in characters a folder name replaces, or in case (macOS and Windows ignore it), or
    a folder that would be another cell's log: each cell still writes into a place of its own."""
    cells = [["model.name_or_path=a/b"], ["model.name_or_path=a b"], ["model.name_or_path=A b"],
             ["x=1.log"], ["x=1"], [f"x={'y' * 300}1"], [f"x={'y' * 300}2"]]
    folders = compare.cell_folders(cells)
    assert folders[:3] == ["model.name_or_path=a_b", "model.name_or_path=a_b-2", "model.name_or_path=A_b-3"]
    assert folders[3:5] == ["x=1.log", "x=1-2"]
    places = [name.casefold() for folder in folders for name in (folder, f"{folder}.log")]
    assert len(set(places)) == len(places) and max(map(len, places)) < 255


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the plot of a comparison where no cell ran
def test_each_cell_runs_into_its_folder(tmp_path, monkeypatch):
    """Two values that one folder name would hold run into two folders."""
    launched = []

    def run_cell(args, cell, output_dir):
        launched.append(output_dir / args.folders[tuple(cell)])
        return "exit 1: (made to fail by the test)"

    monkeypatch.setattr(compare, "run_cell", run_cell)
    assert compare.main(["--recipe", "tiny_llama", "--vary", f"data.cache_dir={tmp_path}/a b,{tmp_path}/a_b",
                         "--output-dir", str(tmp_path / "out")]) == 1  # every cell failed
    assert len(set(launched)) == 2 and {path.parent for path in launched} == {tmp_path / "out"}


def test_the_default_folder_takes_the_next_free_name(tmp_path, monkeypatch, tree_guard, no_launch):
    monkeypatch.setattr(compare, "OUTPUT_ROOT", tmp_path / "outputs")
    earlier = tmp_path / "outputs" / "compare-tiny_llama"
    earlier.mkdir(parents=True)
    (earlier / "comparison.md").write_text("an earlier comparison")
    (earlier / ".written-by.json").write_text('{"command": "tools/compare.py"}\n')
    (tmp_path / "outputs" / "compare-tiny_llama-2").write_text("a file of the user's")
    with tree_guard(), pytest.raises(Launched) as launched:
        compare.main(["--recipe", "tiny_llama", *LR, "--overwrite"])
    assert launched.value.args[0] == tmp_path / "outputs" / "compare-tiny_llama-3"
    assert written_by(launched.value.args[0]) == "tools/compare.py"


def test_an_existing_output_dir_is_replaced_only_with_overwrite_and_only_a_comparison(tmp_path, capsys, tree_guard,
                                                                                     no_launch):
    earlier, mine = tmp_path / "earlier", tmp_path / "mine"
    for folder in (earlier, mine):
        folder.mkdir()
        (folder / "comparison.md").write_text("kept")
    (earlier / ".written-by.json").write_text('{"command": "tools/compare.py"}\n')
    with tree_guard():
        refused(capsys, [*LR, "--output-dir", str(earlier)], f"--output-dir {earlier} already exists; choose another "
                "--output-dir, or pass --overwrite to replace an earlier output of tools/compare.py")
        refused(capsys, [*LR, "--output-dir", str(mine), "--overwrite"], "--overwrite replaces only an earlier output "
                "of tools/compare.py")
        for name in ("a", "b"):
            shutil.copytree(REPO / "recipes/tiny_llama/tokenizer", tmp_path / name)
        refused(capsys, [*LR, f"tokenizer.name_or_path={tmp_path / 'a'}", "--output-dir", str(tmp_path)],
                f"--output-dir {tmp_path} contains {tmp_path / 'a'}, which this command reads")
        refused(capsys, ["--vary", f"tokenizer.name_or_path={tmp_path / 'a'},{tmp_path / 'b'}", "--output-dir",
                         str(tmp_path / "b" / "out")],  # the second cell's input: every cell's inputs count
                f"--output-dir {tmp_path / 'b' / 'out'} lies inside {tmp_path / 'b'}, which this command reads")
    with tree_guard(earlier), pytest.raises(Launched):
        compare.main(["--recipe", "tiny_llama", *LR, "--output-dir", str(earlier), "--overwrite"])
    assert not (earlier / "comparison.md").exists() and written_by(earlier) == "tools/compare.py"


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the plot of a comparison where no cell ran
def test_overwrite_replaces_the_comparisons_files_and_keeps_the_users(tmp_path, monkeypatch, capsys):
    """Issue 50: --overwrite removed a MY_ANALYSIS.md a user had put beside an earlier comparison. Its own files go
    (each cell's run, log and the reports), every other file stays and is named; a file of the user's where the new
    comparison writes (inside a cell's folder) is refused before anything is removed."""
    def run_cell(args, cell, output_dir):  # what a cell leaves: train.py's marked folder and the console log
        folder = output_dir / args.folders[tuple(cell)]
        folder.mkdir()
        (folder / ".written-by.json").write_text('{"command": "train.py"}\n')
        (folder / "metrics.jsonl").write_text("")
        (output_dir / f"{folder.name}.log").write_text("the console")
        return "exit 1: (made to fail by the test)"

    monkeypatch.setattr(compare, "run_cell", run_cell)
    out, argv = tmp_path / "out", ["--recipe", "tiny_llama", "--vary", "training.lr=0.001", "--output-dir",
                                   str(tmp_path / "out")]
    assert compare.main(argv) == 1
    (out / "MY_ANALYSIS.md").write_text("mine")
    (out / "notes").mkdir()
    (out / "notes" / "plot.py").write_text("mine")
    assert compare.main([*argv, "--overwrite"]) == 1
    assert "kept 2 files that tools/compare.py did not write: MY_ANALYSIS.md, notes/plot.py" in capsys.readouterr().out
    assert (out / "MY_ANALYSIS.md").read_text() == (out / "notes" / "plot.py").read_text() == "mine"
    assert (out / "comparison.md").is_file() and (out / "training.lr=0.001" / "metrics.jsonl").is_file()
    (out / "training.lr=0.001" / "mine.txt").write_text("mine")
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    refused(capsys, [*argv[2:], "--overwrite"], "holds training.lr=0.001/mine.txt, which tools/compare.py did not "
            "write, where the comparison writes: nothing was deleted")
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


@pytest.mark.slow
def test_a_second_comparison_keeps_the_first(tmp_path, monkeypatch, data_cache, capsys, tree_guard):
    """Run twice with the default folder: the second goes to compare-tiny_llama-2 and the first is untouched; into
    the first's folder by name it is refused."""
    monkeypatch.setattr(compare, "OUTPUT_ROOT", tmp_path / "outputs")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--recipe", "tiny_llama", "--vary", "training.lr=0.003", "--steps", "2", SMALL_MODEL, data_cache]
    first = tmp_path / "outputs" / "compare-tiny_llama"
    assert compare.main(argv) == 0
    with tree_guard():
        assert compare.main(argv) == 0
        refused(capsys, [*argv[2:], "--output-dir", str(first)], "already exists; choose another --output-dir, or "
                "pass --overwrite")
    for folder in (first, first.with_name("compare-tiny_llama-2")):
        with (folder / "comparison.csv").open() as file:
            assert [row["status"] for row in csv.DictReader(file)] == ["ok"]
        assert (folder / "training.lr=0.003" / "summary.json").is_file()


def test_a_runs_loss_curve_leaves_out_its_event_lines(tmp_path):
    """metrics.jsonl's stability events and checkpoint benchmark scores are event lines of their own at a step that
    also has its step record: the curve keeps the step's loss."""
    import json
    summary = {"mean_tokens_per_s": 10.0, "peak_mem_bytes": 1, "final_loss": 7.5}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": 1, "loss": 8.0}, {"step": 2, "loss": 7.5},
             {"event": "spike", "step": 2, "loss": 30.0},
             {"event": "benchmark", "step": 2, "benchmarks": {"python_docs_mc": {"acc": 0.25}}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row, losses = compare.read_run(tmp_path)
    assert losses == {1: 8.0, 2: 7.5} and row["final_loss"] == 7.5


def test_a_grpo_cell_shows_its_reward_from_first_to_last(tmp_path):
    """A GRPO loss is no measure of progress (it hovers near 0 whatever the policy learns): the table adds the
    first and the last logged reward, from the run's summary.json; and the seconds a step spent generating, a mean
    after step 1 (with num_iterations 2 every other step generates)."""
    import json
    summary = {"mean_tokens_per_s": 10.0, "peak_mem_bytes": 1, "final_loss": 0.01, "generation_time_s": 0.0,
               "first_reward": 0.125, "reward": 0.75}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": 1, "loss": 0.01, "generation_time_s": 3.0}, {"step": 2, "loss": 0.01, "generation_time_s": 1.0},
             {"step": 3, "loss": 0.02, "generation_time_s": 0.0}]  # num_iterations 2: every other step generates
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row, _ = compare.read_run(tmp_path)
    args = compare.parse_args(["--recipe", "tiny_llama_grpo", "--vary", "grpo.loss_type=dapo,cispo"])
    table = comparison_report.markdown([{"cell": "grpo.loss_type=dapo", **row, "max_loss_diff": 0.0}], args,
                             "grpo.loss_type=dapo")
    assert "| reward (first -> last) |" in table and "| 0.50 | 0.125 -> 0.750 |" in table


def test_each_cell_carries_the_plans_peak(tmp_path):
    """A cell's planned peak is the --dry-run table's for its setting: the model states with one micro-batch's
    activations, or a GRPO generation where that is larger (micro-batch 1 of tiny_llama_grpo's 64 completions)."""
    import train
    from tests.conftest import save_small_checkpoint
    from training.objectives.grpo.memory import generation
    from training.planning.activations import activation_bytes, activation_inputs
    from training.planning.memory import planned_model_states
    save_small_checkpoint(tmp_path / "base")
    args = compare.parse_args(["--recipe", "tiny_llama_grpo", "--vary", "training.micro_batch_size=1,32",
                               f"model.name_or_path={tmp_path / 'base'}", "grpo.beta=0"])
    for cell, grows_by in zip(args.cells, ("generation", "activations")):
        estimate = compare.check_cell(args, cell).estimate
        plan = train.make_plan(train.parse_args(["--recipe", "tiny_llama_grpo", "--dry-run",
                                                 *compare.cell_overrides(args, cell)]), world_size=1)
        states = planned_model_states(plan)
        added = {"generation": generation(plan.recipe, plan.precision, plan.shape, plan.zero_stage, 1).total,
                 "activations": activation_bytes(plan.shape, activation_inputs(plan.recipe, plan.precision, plan.shape)
                                                 .at_setting(plan.zero_setting)).peak(False)}
        assert added[grows_by] > added[next(other for other in added if other != grows_by)]
        assert estimate["planned_peak_bytes"] == states.device_bytes + added[grows_by] - states.made_in_backward


def test_a_phase_weight_varies_and_the_table_shows_each_sources_tokens(tmp_path, no_launch):
    """--vary data.phases.1.weights.pydoc (a key the fixed phases leave out, as test_a_varied_key_may_go_inside_a_fixed_
    mapping): each cell's anneal phase weighs the source as its label says, every check passes; the table adds each
    source's tokens read (the last logged step's) and the eval loss."""
    import json
    corpus = REPO / "recipes" / "tiny_llama" / "corpus.jsonl"
    argv = ["--recipe", "tiny_llama", "--vary", "data.phases.1.weights.pydoc=1,3",
            f"data.sources=[{{path: {corpus}, label: docstring}}, {{path: {corpus}, label: pydoc}}]",
            "data.phases=[{name: main, weights: {docstring: 4, pydoc: 1}}, {name: anneal, steps: decay, "
            "weights: {docstring: 1}}]", "training.schedule=wsd", "--output-dir", str(tmp_path / "out")]
    with pytest.raises(Launched):
        compare.main(argv)
    args = compare.parse_args(argv)
    assert [load_recipe(args.recipe, compare.cell_overrides(args, cell)).data.phases[1].weights
            for cell in args.cells] == [{"docstring": 1, "pydoc": 1}, {"docstring": 1, "pydoc": 3}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"mean_tokens_per_s": 10.0, "peak_mem_bytes": 1, "final_loss": 5.0,
                                                  "eval_loss": 5.25}))
    lines = [{"step": 1, "loss": 5.5, "source_tokens": {"docstring": 3072, "pydoc": 1024}},
             {"step": 2, "loss": 5.0, "source_tokens": {"docstring": 4096, "pydoc": 4096}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row, _ = compare.read_run(run)
    table = comparison_report.markdown([{"cell": "x", **row, "max_loss_diff": 0.0}], args, "x")
    assert "| tokens per source | eval loss | final loss |" in table
    assert "| docstring 4,096, pydoc 4,096 | 5.2500 | 5.0000 |" in table
