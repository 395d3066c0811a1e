"""deepspeed.config=auto (training/config/auto_config.py): the choice is the first setting, least sharded first, that
the printed plan says fits; checkpointing only when needed; refused settings passed over; nothing fitting
exits 2 with the numbers and what would fit."""
import json
import re

import yaml

import train
from tests.conftest import SMALL_MODEL, train_in_process
from tests.test_train import no_model_building  # noqa: F401 (a fixture)

ORDER = ["0", "1", "2", "3", "3 + offload"]


def plan_output(capsys, recipe: str, *overrides: str, gpus: int = 8, memory: int = 80) -> str:
    args = ["--recipe", recipe, "--dry-run", "--num-gpus", str(gpus), "--gpu-mem", str(memory),
            "deepspeed.config=auto", *overrides]
    assert train.main(args) == 0
    return capsys.readouterr().out


def first_fitting_row(output: str, checkpointing: bool) -> str | None:
    """The plan table's first setting in ORDER whose totals fit, without (or with) checkpointing."""
    fits = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 7:
            fits[cells[0].replace(" (this run)", "")] = cells[6]
    wanted = ("yes", "with checkpointing") if checkpointing else ("yes",)
    return next((setting for setting in ORDER if fits[setting] in wanted), None)


def chosen(output: str) -> tuple[str, bool]:
    match = re.search(r"DeepSpeed: (\w+)\.json \(ZeRO-\d chosen by deepspeed.config=auto.*activation checkpointing "
                      r"(on|off)", output)
    return match[1], match[2] == "on"


def test_llama2_7b_on_8_gpus_takes_the_first_stage_that_fits(no_model_building, capsys):
    output = plan_output(capsys, "llama2_7b", "activation_checkpointing=false")
    assert first_fitting_row(output, checkpointing=False) is None  # 4 x 4,096 tokens a rank: 100 GiB of activations
    assert chosen(output) == ("zero1", True)  # so checkpointing is turned on
    assert first_fitting_row(output, checkpointing=True) == "1"


def test_a_70b_model_on_8_gpus_takes_zero3_with_offload(no_model_building, capsys):
    output = plan_output(capsys, "llama3_70b", "parallelism.tensor_parallel=1")
    assert chosen(output) == ("zero3_offload", True)
    assert first_fitting_row(output, checkpointing=True) == "3 + offload"


def test_settings_the_checks_refuse_are_passed_over(no_model_building, capsys):
    # tensor parallelism refuses ZeRO-0, which fits: the next that fits
    output = plan_output(capsys, "tiny_llama", "parallelism.tensor_parallel=2", gpus=2)
    assert chosen(output) == ("zero1", False)


def test_nothing_fits_exits_2_with_the_numbers_and_what_would(no_model_building, capsys):
    args = ["--recipe", "llama3_70b", "--dry-run", "--num-gpus", "1", "--gpu-mem", "24", "deepspeed.config=auto",
            "parallelism.tensor_parallel=1"]
    assert train.main(args) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "deepspeed.config=auto: nothing fits in 21.60 GiB per rank (90% of 24.00 GiB, --gpu-mem)" in error
    assert "the smallest is ZeRO-3 + offload with activation checkpointing: 27.58 GiB" in error
    assert "What would fit: data.seq_len=4096" in error


def test_what_fits_but_is_refused_is_named(no_model_building, capsys):
    args = ["--recipe", "llama3_70b", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80", "deepspeed.config=auto",
            "parallelism.tensor_parallel=1", "optimizer.name=muon", "training.grad_clip=0"]
    assert train.main(args) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "what fits, the run's checks refuse: zero3_offload: optimizer.name=muon: ZeRO-Offload" in error


def test_on_a_cpu_the_run_writes_the_config_it_chose(tmp_path, data_cache):
    """Against this machine's RAM over its ranks: tiny_llama fits without sharding."""
    out = tmp_path / "run"
    result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                               "deepspeed.config=auto", "training.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "zero0.json (ZeRO-0 chosen by deepspeed.config=auto" in result.stdout
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 0
    assert yaml.safe_load((out / "resolved_recipe.yaml").read_text())["deepspeed"]["config"] == "zero0"
