"""training/parallel/support.py: what each feature runs with in each layout, one table walked by one check that
reports every refusal at once (the table as docs/parallelism.md quotes it: tests/test_docs.py)."""
import pytest

import train
from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.parallel.support import check_support, refusals
from training.planning.layout import ParallelDims


def layout_refusals(recipe_name: str, *overrides: str, world_size: int = 4) -> list[str]:
    recipe = load_recipe(recipe_name, list(overrides))
    return refusals(recipe, None, ParallelDims.of(recipe.parallelism, world_size))


def test_every_refusal_is_reported_and_a_pair_of_degrees_once():
    assert layout_refusals("tiny_llama_grpo", "parallelism.tensor_parallel=2", "parallelism.sequence_parallel=2") == [
        "training.objective=grpo with parallelism.tensor_parallel=2: not built; set parallelism.tensor_parallel=1",
        "training.objective=grpo with parallelism.sequence_parallel=2: a completion is sampled whole; set "
        "parallelism.sequence_parallel=1",
        "parallelism.tensor_parallel > 1 with parallelism.sequence_parallel=2: DeepSpeed 0.19.8 replaces the "
        "sequence-parallel groups with its tensor-parallel ones under AutoTP; set parallelism.sequence_parallel=1, or "
        "parallelism.tensor_parallel=1"]


def test_lora_with_pipeline_and_tensor_parallelism_is_refused_in_one_error():
    recipe = load_recipe("tiny_llama", ["lora.enabled=true", "model.name_or_path=somewhere",
                                        "parallelism.pipeline_stages=2", "parallelism.tensor_parallel=2"])
    with pytest.raises(ConfigError) as refused:
        check_support(recipe, None, ParallelDims.of(recipe.parallelism, 4))
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("3 setting(s) this layout does not run")
    assert lines[1:] == [
        "  lora.enabled with parallelism.pipeline_stages=2: the pipeline rebuilds the model's layers without the "
        "adapters; set parallelism.pipeline_stages=1, or lora.enabled=false",
        "  lora.enabled with parallelism.tensor_parallel=2: AutoTP splits nn.Linear layers, not peft's adapter "
        "layers; set parallelism.tensor_parallel=1, or lora.enabled=false",
        "  parallelism.pipeline_stages > 1 with parallelism.tensor_parallel=2: tensor parallelism with pipeline "
        "stages is not built; set parallelism.tensor_parallel=1, or parallelism.pipeline_stages=1"]


@pytest.mark.parametrize("recipe_name, override, expected", [
    ("tiny_llama_dpo", "parallelism.pipeline_stages=2", "training.objective=dpo with parallelism.pipeline_stages=2"),
    ("tiny_llama_dpo", "parallelism.sequence_parallel=2", "sequence's whole log-probability"),
    ("tiny_llama_grpo", "parallelism.pipeline_stages=2", "training.objective=grpo with parallelism.pipeline_stages"),
])
def test_an_objective_refuses_the_degrees_its_spec_names(recipe_name, override, expected):
    """Moved here from the objectives' checks (their specs' refused_layouts)."""
    assert [line for line in layout_refusals(recipe_name, override) if expected in line]


def test_a_layout_every_feature_runs_with_passes():
    assert layout_refusals("tiny_llama", "parallelism.tensor_parallel=2") == []


def test_train_reports_them_all_before_the_other_checks(no_model_building, capsys):
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "4", "--gpu-mem", "80", "optimizer.name=muon",
            "parallelism.tensor_parallel=2", "parallelism.sequence_parallel=2", "deepspeed.config=zero2"]
    assert train.main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "3 setting(s) this layout does not run" in err
    assert all(f"{feature} with parallelism.{degree}=2" in err for feature, degree in (
        ("optimizer.name=muon", "tensor_parallel"), ("optimizer.name=muon", "sequence_parallel"),
        ("parallelism.tensor_parallel > 1", "sequence_parallel")))
