"""deepspeed.config=auto (training/planning/auto_config.py): the choice is the first setting, least sharded first, that
the printed plan says fits; checkpointing only when needed; refused settings passed over; nothing fitting
exits 2 with the numbers and what would fit."""
import json
import re
from dataclasses import replace

import pytest
import yaml

import train
from tests.conftest import SMALL_MODEL, train_in_process
from training.config.recipe import load_recipe
from training.models.model import load_model_config
from training.planning.auto_config import AUTO_ORDER, candidates, expert_parallel_size, memory_needs
from training.planning.memory import fits
from training.planning.plan import Machine
from training.planning.shape import model_shape

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
    output = plan_output(capsys, "llama2_7b", "activation_checkpointing=false", "training.micro_batch_size=8")
    assert first_fitting_row(output, checkpointing=False) is None  # 8 x 4,096 tokens a rank: 131 GiB of activations
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
    assert "the smallest is ZeRO-3 + offload with activation checkpointing: 24.43 GiB (4.04 GiB model states" in error
    assert "What would fit: data.seq_len=4096" in error


def test_what_fits_but_is_refused_is_named(no_model_building, capsys):
    args = ["--recipe", "llama3_70b", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80", "deepspeed.config=auto",
            "parallelism.tensor_parallel=1", "optimizer.name=muon", "training.grad_clip=0"]
    assert train.main(args) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "what fits, the run's checks refuse: zero3_offload: optimizer.name=muon: ZeRO-Offload" in error


@pytest.mark.parametrize("recipe_name, nodes, split", [("mixtral_8x7b", 4, "1 of each layer's 8"),
                                                       ("qwen3_30b_a3b", 2, "16 of each layer's 128")])
def test_a_mixture_of_experts_splits_its_experts_rather_than_take_zero3(no_model_building, capsys, recipe_name, nodes,
                                                                        split):
    """The MoE recipes on their target nodes of 8: ZeRO-0 to 2 do not fit, ZeRO-3 does, and before it ZeRO-1 with each
    layer's experts split over the 8 GPUs of a node."""
    recipe, machine = load_recipe(recipe_name), Machine(8, nodes, 80 * 2**30, "--gpu-mem")
    needs = [need for need in memory_needs(recipe, model_shape(load_model_config(recipe.model)), "bf16", machine)
             if fits(need.total, machine.memory_per_rank)]
    without_experts_split = next(need for need in needs if need.expert_parallel == 1)
    assert (without_experts_split.setting, without_experts_split.checkpointing) == ("3", True)
    assert (needs[0].setting, needs[0].checkpointing, needs[0].expert_parallel) == ("1", True, 8)
    output = plan_output(capsys, recipe_name, "--num-nodes", str(nodes))
    assert chosen(output) == ("zero1", True)
    assert f"; experts: 8 expert-parallel x {nodes} expert-data-parallel ({split} experts per rank)" in output


def test_expert_parallelism_where_it_does_not_fit_is_passed_over(no_model_building, capsys):
    # one node of 8: a rank's one expert of each layer keeps its states unsharded, over 80 GB
    output = plan_output(capsys, "mixtral_8x7b")
    assert chosen(output) == ("zero3_offload", True)
    assert "expert-parallel" not in output


def test_a_recipes_expert_parallelism_is_kept(no_model_building, capsys):
    output = plan_output(capsys, "qwen3_30b_a3b", "--num-nodes", "2", "parallelism.expert_parallel=16")
    assert chosen(output) == ("zero1", True)
    assert "experts: 16 expert-parallel x 1 expert-data-parallel" in output


def test_a_dense_model_has_the_candidates_it_had():
    shape = model_shape(load_model_config(load_recipe("llama3_8b").model))
    machine = Machine(8, 4, 80 * 2**30, "--gpu-mem")
    assert expert_parallel_size(shape, machine) == 1
    assert candidates(load_recipe("llama3_8b"), shape, machine) == [(setting, 1) for setting in AUTO_ORDER]


@pytest.mark.parametrize("gpus_per_node, experts, size", [(8, 8, 8), (8, 128, 8), (8, 6, 2), (6, 8, 2), (4, 60, 4)])
def test_the_expert_parallelism_tried_stays_in_a_node(gpus_per_node, experts, size):
    shape = model_shape(load_model_config(load_recipe("mixtral_8x7b").model))
    machine = Machine(gpus_per_node, 2, 80 * 2**30, "--gpu-mem")
    assert expert_parallel_size(replace(shape, num_experts=experts), machine) == size


@pytest.mark.slow
def test_on_a_cpu_the_run_writes_the_config_it_chose(tmp_path, data_cache):
    """Against this machine's RAM over its ranks: tiny_llama fits without sharding, and the whole global batch of 16
    rows in one micro-batch (training.micro_batch_size=auto, training/planning/micro_batch.py), which the run's files
    and its checkpoint record as a number."""
    out = tmp_path / "run"
    result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                               "deepspeed.config=auto", "training.micro_batch_size=auto", "training.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "zero0.json (ZeRO-0 chosen by deepspeed.config=auto" in result.stdout
    assert "micro-batch: 16 chosen by training.micro_batch_size=auto" in result.stdout
    ds_config = json.loads((out / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 0
    assert (ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]) == (16, 1)
    resolved = yaml.safe_load((out / "resolved_recipe.yaml").read_text())
    assert (resolved["deepspeed"]["config"], resolved["training"]["micro_batch_size"]) == ("zero0", 16)
    assert json.loads((out / "checkpoints/global_step2/run_state.json").read_text())["micro_batch_size"] == 16
