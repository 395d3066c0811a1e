"""--resume on another world size, ZeRO stage or precision, through the launcher: the checkpoint is converted
into a DeepSpeed universal checkpoint and the run continues the uninterrupted run's curve.

Every interrupted run checkpoints every 3 steps and is SIGKILLed in the middle of step 9's save, so `latest`
stays at step 6; it resumes in another layout and trains to step 12. The reference is one uninterrupted run
(2 ranks, ZeRO-2, fp32): the global batch is the same for any number of ranks, and the ZeRO stages do the
same arithmetic. Tolerances (fp32):
- losses: 1e-5 relative (measured: 6e-8 for ZeRO-2 -> ZeRO-3 and ZeRO-1 -> ZeRO-3, 1.2e-7 for ZeRO-3 -> ZeRO-1 and
  for sequence parallelism 2 -> none and none -> 2);
- the final fp32 weights and AdamW moments, both converted to universal files and compared tensor by tensor:
  the largest difference within 1e-4 of the tensor's largest value (measured: weights 1.3e-5, moments 2e-7;
  Adam divides by the square root of the second moment, which magnifies summation-order differences
  where that moment is tiny);
- bf16 -> fp32: the first resumed loss within 2e-3 (the suite's bf16 tolerance) of the bf16 run's own;
  fp32 -> bf16 (DeepSpeed's BF16_Optimizer loading the universal checkpoint): the resumed curve within 2e-3
  of the fp32 run's (measured: 3.4e-4).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_MODEL, run_train

pytestmark = pytest.mark.slow

PROBES = "tests/helpers/train_with_probes.py"
STEPS, KILLED_AT, RESUMED_FROM = 12, 9, 6
CASES = {  # name: (ranks, ds_config [and sequence parallelism], precision) that wrote the checkpoint, then those that
    # resume it
    "2 ranks ZeRO-2 -> 1 rank ZeRO-3": ((2, "zero2", "fp32"), (1, "zero3", "fp32")),
    "2 ranks SP=2 ZeRO-2 -> 1 rank ZeRO-3": ((2, "zero2 sp2", "fp32"), (1, "zero3", "fp32")),
    "2 ranks ZeRO-2 -> 2 ranks SP=2 ZeRO-3": ((2, "zero2", "fp32"), (2, "zero3 sp2", "fp32")),
    "1 rank ZeRO-1 -> 2 ranks ZeRO-3": ((1, "zero1", "fp32"), (2, "zero3", "fp32")),
    "2 ranks ZeRO-3 -> 1 rank ZeRO-1": ((2, "zero3", "fp32"), (1, "zero1", "fp32")),
    "2 ranks bf16 ZeRO-1 -> 1 rank fp32 ZeRO-2": ((2, "zero1", "bf16"), (1, "zero2", "fp32")),
    "2 ranks fp32 ZeRO-2 -> 1 rank bf16 ZeRO-1": ((2, "zero2", "fp32"), (1, "zero1", "bf16")),
}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def layout_args(ds_config: str, precision: str) -> list[str]:
    """`zero3 sp2`: ZeRO-3 with sequence parallelism 2."""
    name, *sequence = ds_config.split()
    return [f"deepspeed.config={name}", f"precision={precision}",
            *(f"parallelism.sequence_parallel={size.removeprefix('sp')}" for size in sequence)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, f"training.max_steps={STEPS}",
              "checkpointing.every_steps=3", "logging.every_steps=1"]
    whole = tmp_path_factory.mktemp("whole")
    result = run_train(["--output-dir", str(whole), *common, *layout_args("zero2", "fp32")], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    runs, killed = {"whole": whole}, {}
    for name, (layout, (new_ranks, new_ds_config, new_precision)) in CASES.items():
        if layout not in killed:
            killed[layout] = killed_run(tmp_path_factory.mktemp("killed"), common, layout)
        out = tmp_path_factory.mktemp("run")
        shutil.copytree(killed[layout], out, dirs_exist_ok=True)
        before = metrics(out)  # the resume rewrites the lines after its checkpoint
        files = sorted(path.name for path in (out / "checkpoints" / f"global_step{RESUMED_FROM}").iterdir())
        if not runs.get("rewind"):  # the first case is also resumed into a spike, rewound to its universal conversion
            runs["rewind"] = resume_into_a_spike(killed[layout], tmp_path_factory.mktemp("rewind"), common,
                                                 CASES[name][1])
        result = run_train(["--output-dir", str(out), "--resume", *common, *layout_args(new_ds_config, new_precision)],
                           ranks=new_ranks)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        runs[name] = {"out": out, "before": before, "files": files, "console": result.stdout}
    return runs


def killed_run(out: Path, common: list[str], layout: tuple) -> Path:
    """A run in `layout` SIGKILLed in the middle of step 9's save, left as the kill left it: the cases that start from
    the same layout each resume a copy of it (the run is deterministic, and its folder holds no path of its own)."""
    ranks, ds_config, precision = layout
    killed = run_train(["--kill-after-deepspeed-save", str(KILLED_AT), "--output-dir", str(out), *common,
                        *layout_args(ds_config, precision)], ranks=ranks, script=PROBES)
    assert killed.returncode != 0 and (out / "checkpoints" / "latest").read_text() == f"global_step{RESUMED_FROM}"
    return out


def resume_into_a_spike(killed: Path, out: Path, common: list[str], layout: tuple) -> tuple[Path, str]:
    """A copy of the killed run resumed in another layout with stability.policy=rewind, a loss spike at step 10, and no
    checkpoint saved before it: the rewind goes back to the checkpoint of the other layout."""
    shutil.copytree(killed, out, dirs_exist_ok=True)
    new_ranks, new_ds_config, new_precision = layout
    result = run_train(["--insert-poisoned-batches", f"spike:{RESUMED_FROM + 3}", "--output-dir", str(out), "--resume",
                        *common, *layout_args(new_ds_config, new_precision), "checkpointing.every_steps=6",
                        "stability.policy=rewind", "stability.min_history=3", "stability.window=3",
                        "stability.spike_sigma=50"], ranks=new_ranks, script=PROBES)
    return out, result.stdout + result.stderr if result.returncode else ""


def test_a_rewind_after_a_resume_in_another_layout_loads_the_universal_conversion(runs):
    out, failure = runs["rewind"]
    assert not failure, failure[-3000:]
    rewinds = [record for record in metrics(out) if record.get("event") == "rewind"]
    assert [(r["step"], r["rewound_to"]) for r in rewinds] == [(RESUMED_FROM + 4, RESUMED_FROM)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_step"] == STEPS and summary["stability"]["rewind"] == 1


def universal_states(checkpoint: Path) -> dict[tuple[str, str], torch.Tensor]:
    """A checkpoint's fp32 weights and AdamW moments, as `python -m training convert` writes them."""
    from training.__main__ import main
    assert main(["convert", str(checkpoint)]) == 0
    zero = checkpoint.parent / "universal" / checkpoint.name / "zero"
    return {(folder.name, key): torch.load(folder / f"{key}.pt", weights_only=False)["param"]
            for folder in zero.iterdir() if folder.is_dir() for key in ("fp32", "exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("case", [name for name in CASES if "bf16" not in name])
def test_resumed_run_continues_the_uninterrupted_curve(runs, case):
    out = runs[case]["out"]
    (new_ranks, new_ds_config, _) = CASES[case][1]
    losses = [record["loss"] for record in metrics(out)]
    reference = [record["loss"] for record in metrics(runs["whole"])]
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], f"zero{summary['zero_stage']}", summary["start_step"]) == \
        (new_ranks, new_ds_config.split()[0], RESUMED_FROM)
    assert json.loads((out / "ds_config.json").read_text())["checkpoint"] == {"load_universal": True}
    universal = out / "checkpoints" / "universal" / f"global_step{RESUMED_FROM}"
    assert f"into a universal checkpoint, {universal} (" in runs[case]["console"]
    assert not universal.exists()  # checkpointing.keep_last=2 removed it with its checkpoint


@pytest.mark.parametrize("case", [name for name in CASES if "bf16" not in name])
def test_resumed_optimizer_state_is_the_uninterrupted_runs(runs, case):
    final = f"checkpoints/global_step{STEPS}"
    expected, resumed = universal_states(runs["whole"] / final), universal_states(runs[case]["out"] / final)
    assert resumed.keys() == expected.keys() and len(expected) == 3 * 21  # every parameter of SMALL_MODEL
    for key, tensor in expected.items():
        assert resumed[key].shape == tensor.shape, key
        assert (resumed[key] - tensor).abs().max() <= 1e-4 * tensor.abs().max(), key


def test_a_bf16_run_resumes_in_fp32_from_its_master_weights(runs):
    case = runs["2 ranks bf16 ZeRO-1 -> 1 rank fp32 ZeRO-2"]
    bf16_run = {record["step"]: record["loss"] for record in case["before"]}  # killed at step 9: 1-9 were logged
    resumed = {record["step"]: record["loss"] for record in metrics(case["out"])}
    assert resumed[RESUMED_FROM + 1] == pytest.approx(bf16_run[RESUMED_FROM + 1], abs=2e-3)
    summary = json.loads((case["out"] / "summary.json").read_text())
    assert (summary["precision"], summary["world_size"], summary["zero_stage"]) == ("fp32", 1, 2)
    assert any(name.startswith("bf16_zero_pp_rank_") for name in case["files"])  # BF16_Optimizer's files were converted


def test_an_fp32_run_resumes_in_bf16_through_the_bf16_optimizers_own_loader(runs):
    """bf16 at ZeRO-1 runs DeepSpeed's BF16_Optimizer, which loads universal checkpoints with its own code."""
    out = runs["2 ranks fp32 ZeRO-2 -> 1 rank bf16 ZeRO-1"]["out"]
    losses = [record["loss"] for record in metrics(out)]
    assert losses == pytest.approx([record["loss"] for record in metrics(runs["whole"])], abs=2e-3)
    assert list((out / "checkpoints" / f"global_step{STEPS}").glob("bf16_zero_pp_rank_*"))  # written by BF16_Optimizer


def test_a_conversion_is_made_once_and_one_a_kill_interrupted_is_made_again(runs):
    from training.state.universal import convert
    checkpoints, tag = runs["whole"] / "checkpoints", f"global_step{KILLED_AT}"
    leftover = checkpoints / "universal" / f".{tag}.partial" / tag
    leftover.mkdir(parents=True)
    (leftover / "optimizer_state.pt").write_bytes(b"cut short")
    target = convert(checkpoints, tag)
    assert target == checkpoints / "universal" / tag and not leftover.parent.exists()
    made = (target / "zero" / "optimizer_state.pt").stat().st_mtime_ns
    assert convert(checkpoints, tag) == target
    assert (target / "zero" / "optimizer_state.pt").stat().st_mtime_ns == made
    fp32 = next((target / "zero").glob("*/fp32.pt"))
    fp32.unlink()  # a cached conversion missing a file is made again, not blamed on the checkpoint
    assert convert(checkpoints, tag) == target and fp32.is_file()
    fp32.write_bytes(fp32.read_bytes()[:100])  # and one cut short
    assert convert(checkpoints, tag) == target and fp32.stat().st_size > 100


def test_a_universal_conversion_averages_as_its_checkpoint(runs, tmp_path):
    """python -m training average reads a universal checkpoint's fp32 files: the whole run's last checkpoint converted
    by DeepSpeed's converter, averaged with the checkpoint before it, gives exactly the two checkpoints' average."""
    from safetensors.torch import load_file

    from training.__main__ import main
    checkpoints = runs["whole"] / "checkpoints"
    before, last = checkpoints / f"global_step{STEPS - 3}", checkpoints / f"global_step{STEPS}"
    assert main(["convert", str(last)]) == 0
    universal = checkpoints / "universal" / last.name
    assert main(["average", str(before), str(last), str(tmp_path / "plain")]) == 0
    assert main(["average", str(before), str(universal), str(tmp_path / "universal")]) == 0
    plain, mixed = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "universal"))
    assert plain.keys() == mixed.keys() and all(torch.equal(plain[name], mixed[name]) for name in plain)
