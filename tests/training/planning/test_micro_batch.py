"""training.micro_batch_size=auto (training/planning/micro_batch.py): for any memory, the largest divisor of the rows
per rank whose planned peak fits, the next larger divisor not fitting; micro-batch 1 not fitting exits 2 with the
numbers and what would fit; under deepspeed.config=auto the config chosen for micro-batch 1; a resume keeps the
checkpoint's micro-batch; the dry run says what it chose, with the numbers of its own memory table."""
import json
import re

import pytest

import train
from tests.conftest import REPO
from training.base.errors import ConfigError
from training.config.recipe import Recipe, load_recipe
from training.models.model import load_model_config
from training.objectives.dpo.spec import DPO_CHUNK_TOKENS
from training.planning.memory import fits, memory_plan
from training.planning.micro_batch import choose_micro_batch
from training.planning.plan import Machine
from training.planning.report import format_bytes
from training.planning.shape import ModelShape, model_shape

# benchmarks/gpu_throughput.py's model and rows, with a global batch that leaves room for accumulation
LLAMA_1B = ["--recipe", "tiny_llama", f"model.config={REPO / 'benchmarks/llama_1b/config.json'}", "data.seq_len=2048",
            "training.global_batch_size=64", "training.micro_batch_size=auto", "precision=bf16"]


def llama_1b(*overrides: str) -> Recipe:
    return load_recipe("tiny_llama", [*LLAMA_1B[2:], *overrides])


def planned(recipe: Recipe, setting: str, machine: Machine, size: int, shape: ModelShape | None = None) -> float:
    """The plan's peak per rank at micro-batch `size`: the setting's model states with its activations, as
    --dry-run's memory table adds them."""
    shape = shape or model_shape(load_model_config(recipe.model))
    sized = recipe.model_copy(update={"training": recipe.training.model_copy(update={"micro_batch_size": size})})
    memory = memory_plan(sized, "bf16", shape, machine)
    return memory.states[setting].peak_with(memory.activations().peak(recipe.activation_checkpointing))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, setting, checkpointing", [(1, "1", False), (4, "2", False), (8, "3", True)])
def test_the_largest_divisor_that_fits_for_any_memory(ranks, setting, checkpointing):
    recipe = llama_1b(f"activation_checkpointing={checkpointing}")
    config = load_model_config(recipe.model)
    shape = model_shape(config)
    rows = 64 // ranks
    divisors = [size for size in range(1, rows + 1) if rows % size == 0]
    chosen_sizes = []
    for gib in (*range(2, 20), *range(20, 200, 6)):  # finely where checkpointed micro-batches change
        machine = Machine(ranks, 1, gib * 2**30, "--gpu-mem")
        try:
            chosen, choice = choose_micro_batch(recipe, config, "bf16", setting, machine, ranks)
        except ConfigError:
            assert not fits(planned(recipe, setting, machine, 1, shape), machine.memory_per_rank)
            assert not chosen_sizes  # a larger memory never fails where a smaller one chose
            continue
        size = chosen.training.micro_batch_size
        assert size == choice.size and size in divisors
        assert size >= max(chosen_sizes, default=1)  # a larger memory never takes a smaller micro-batch
        assert choice.planned_bytes == pytest.approx(planned(recipe, setting, machine, size, shape))
        assert fits(choice.planned_bytes, machine.memory_per_rank)
        larger = [divisor for divisor in divisors if divisor > size]
        if larger:
            assert choice.larger == (larger[0], pytest.approx(planned(recipe, setting, machine, larger[0], shape)))
            assert not fits(choice.larger[1], machine.memory_per_rank)
        else:
            assert choice.larger is None
        assert chosen.training.global_batch_size == 64 and recipe.training.micro_batch_size == "auto"
        chosen_sizes.append(size)
    assert len(set(chosen_sizes)) >= min(4, len(divisors) - 1)  # the sweep goes through several choices, not one


def test_dpo_plans_two_rows_per_pair():
    """Under DPO a micro-batch of m pairs is planned as 2m rows, and its token statistics' chunk: the pairs that fit are
    half the rows that do."""
    machine = Machine(1, 1, 80 * 2**30, "--gpu-mem")
    config = load_model_config(llama_1b().model)
    rows, _ = choose_micro_batch(llama_1b("fused_loss=false"), config, "bf16", "1", machine, 1)  # DPO's loss: unfused
    pairs_recipe = load_recipe("tiny_llama_dpo", LLAMA_1B[2:])
    pairs, choice = choose_micro_batch(pairs_recipe, config, "bf16", "1", machine, 1)
    assert pairs.training.micro_batch_size == rows.training.micro_batch_size // 2
    statistics = DPO_CHUNK_TOKENS * 12 * config.vocab_size
    assert choice.planned_bytes == pytest.approx(planned(rows, "1", machine, 2 * pairs.training.micro_batch_size)
                                                 + statistics)


def test_micro_batch_1_not_fitting_exits_2_with_the_numbers_and_what_would_fit(no_model_building, capsys):
    assert train.main([*LLAMA_1B, "--dry-run", "--num-gpus", "1", "--gpu-mem", "40", "data.seq_len=16384"]) == 2
    error = " ".join(capsys.readouterr().err.split())
    plan = train.make_plan(train.parse_args([*LLAMA_1B, "--dry-run", "--num-gpus", "1", "--gpu-mem", "40",
                                             "data.seq_len=16384", "training.micro_batch_size=1"]))
    recipe, machine = plan.recipe, Machine(1, 1, 40 * 2**30, "--gpu-mem")  # its attention resolved for a GPU
    assert (f"training.micro_batch_size=auto: even micro-batch 1 does not fit in 36.00 GiB per rank (90% of 40.00 GiB, "
            f"--gpu-mem): the plan is {format_bytes(planned(recipe, '1', machine, 1))}") in error
    # ZeRO-0 (torch autocast) keeps 16 bytes per parameter, ZeRO-1 on one GPU 20 (its fp32 gradient copy)
    assert "activation checkpointing off). What would fit: deepspeed.config=zero0" in error
    assert "activation_checkpointing=true data.seq_len=8192" in error


def test_what_fits_under_no_single_change_says_so():
    recipe, machine = llama_1b("data.seq_len=16384"), Machine(1, 1, 24 * 2**30, "--gpu-mem")
    with pytest.raises(ConfigError, match="What would fit:\n  none of a more sharded ZeRO setting, checkpointing or "
                                          "shorter rows alone: deepspeed.config=auto"):
        choose_micro_batch(recipe, load_model_config(recipe.model), "bf16", "1", machine, 1)


@pytest.mark.parametrize("overrides, ranks, message", [
    (["parallelism.pipeline_stages=2"], 1, "with parallelism.pipeline_stages > 1: a pipeline's bubble shrinks"),
    (["training.global_batch_size=12"], 8,
     "training.global_batch_size=12 is not a multiple of the 8 data-parallel ranks"),
])
def test_what_auto_refuses(overrides, ranks, message):
    recipe = llama_1b(*overrides)
    with pytest.raises(ConfigError, match=message):
        choose_micro_batch(recipe, load_model_config(recipe.model), "bf16", "1", Machine(8, 1, 80 * 2**30, "x"), ranks)


@pytest.mark.parametrize("value", ["auto", 4])
def test_the_schema_takes_auto_and_numbers(value):
    assert load_recipe("tiny_llama", [f"training.micro_batch_size={value}"]).training.micro_batch_size == value


@pytest.mark.parametrize("value", ["big", "0", "-2", "2.5", "null"])
def test_the_schema_refuses_anything_else_in_one_message(value):
    with pytest.raises(ConfigError) as error:
        load_recipe("tiny_llama", [f"training.micro_batch_size={value}"])
    message = str(error.value)
    assert "has 1 problem(s)" in message
    assert ("training.micro_batch_size: a positive whole number of rows per rank, or auto (the largest micro-batch "
            "that fits the memory plan") in message


def test_the_dry_run_says_what_it_chose_with_its_tables_numbers(no_model_building, capsys):
    assert train.main([*LLAMA_1B, "--dry-run", "--num-gpus", "1", "--gpu-mem", "80"]) == 0
    output = capsys.readouterr().out
    line = re.search(r"micro-batch: (\d+) chosen by training.micro_batch_size=auto, the largest divisor of the 64 rows "
                     r"per rank and step that fits: ([\d.,]+ GiB) per rank within 72.00 GiB \(90% of 80.00 GiB, "
                     r"--gpu-mem\); (\d+) would need ([\d.,]+ GiB)", output)
    size, larger = int(line[1]), int(line[3])
    assert larger == 2 * size and f"batch: {size} rows/rank x {64 // size} accumulation x 1" in output
    this_run = next(row for row in output.splitlines() if "(this run)" in row).split("│")
    assert this_run[5].strip() == line[2]  # the table's model states + activations at this micro-batch
    assert float(line[4].split()[0]) > 72.0


def test_the_plan_carries_the_number_into_both_configs(no_model_building):
    plan = train.make_plan(train.parse_args([*LLAMA_1B, "--dry-run", "--num-gpus", "2", "--gpu-mem", "80"]))
    size = plan.micro_batch.size
    assert plan.recipe.model_dump(mode="json")["training"]["micro_batch_size"] == size  # resolved_recipe.yaml
    assert plan.ds_config["train_micro_batch_size_per_gpu"] == size
    assert plan.ds_config["gradient_accumulation_steps"] == plan.accumulation_steps == 64 // (2 * size)
    assert plan.ds_config["train_batch_size"] == 64


@pytest.mark.parametrize("gib", [24, 40, 80])
def test_with_deepspeed_config_auto_the_config_is_micro_batch_1s(no_model_building, gib):
    what_if = ["--dry-run", "--num-gpus", "1", "--gpu-mem", str(gib), "deepspeed.config=auto"]
    both = train.make_plan(train.parse_args([*LLAMA_1B, *what_if]))
    for_one = train.make_plan(train.parse_args([*LLAMA_1B, *what_if, "training.micro_batch_size=1"]))
    assert (both.ds_config_path, both.recipe.activation_checkpointing) == \
        (for_one.ds_config_path, for_one.recipe.activation_checkpointing)
    under_it = for_one.recipe.model_copy(update={"training": for_one.recipe.training.model_copy(
        update={"micro_batch_size": "auto"})})  # its config, attention and compile as the plan resolved them
    alone, _ = choose_micro_batch(under_it, both.model_config, "bf16", for_one.zero_setting,
                                  both.micro_batch.machine, 1)
    assert both.recipe.training.micro_batch_size == alone.training.micro_batch_size


@pytest.mark.parametrize("saved, expected", [(2, 2), (3, 16), (None, 16)],
                         ids=["kept", "not a divisor", "not recorded"])
def test_a_resume_keeps_the_checkpoints_micro_batch(earlier_run, no_model_building, capsys, saved, expected):
    """tiny_llama on this machine's RAM chooses 16 rows (no accumulation); a checkpoint trained at 2 resumes at 2 (the
    same arithmetic), one at a size that no longer divides the rows per rank resumes at the new choice."""
    state = {"step": 4, "tokens_seen": 400, "world_size": 1, "zero_stage": 1, "precision": "fp32",
             **({"micro_batch_size": saved} if saved else {})}
    (earlier_run / "checkpoints" / "global_step4" / "run_state.json").write_text(json.dumps(state))
    args = ["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume", "precision=fp32",
            "training.max_steps=8", "training.micro_batch_size=auto"]
    plan = train.make_plan(train.parse_args(args))
    assert plan.recipe.training.micro_batch_size == expected and plan.micro_batch.kept == (saved == 2)
    assert plan.recipe.training.global_batch_size == 16 and plan.accumulation_steps == 16 // expected
    train.show_plan(plan, plan.planned_for)
    said = "2, the checkpoint's, kept by" if saved == 2 else "16 chosen by"
    assert f"micro-batch: {said} training.micro_batch_size=auto" in capsys.readouterr().out
