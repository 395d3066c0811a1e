import pytest

from training.base.errors import ConfigError
from training.config.recipe import RECIPES_DIR, available_recipes, load_recipe


@pytest.mark.parametrize("name", available_recipes())
def test_every_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.path == RECIPES_DIR / name / "recipe.yaml"
    assert (RECIPES_DIR / name / "README.md").is_file()


def test_paths_in_the_file_count_from_the_recipe_folder():
    recipe = load_recipe("tiny_llama")
    assert recipe.model.config == str(RECIPES_DIR / "tiny_llama" / "config.json")
    assert recipe.tokenizer_path == str(RECIPES_DIR / "tiny_llama" / "tokenizer")
    assert recipe.data.sources[0].path == str(RECIPES_DIR / "tiny_llama" / "corpus.jsonl")


def test_overrides_are_yaml_values_and_paths_count_from_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "mine.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("tiny_llama", ["training.max_steps=20", "training.betas=[0.8, 0.9]", "precision=bf16",
                                        "data.sources.0.path=mine.jsonl",
                                        "deepspeed.overrides.zero_optimization.stage=2"])
    assert recipe.training.max_steps == 20
    assert recipe.training.betas == (0.8, 0.9)
    assert recipe.precision == "bf16"
    assert recipe.data.sources[0].path == str(tmp_path / "mine.jsonl")
    assert recipe.deepspeed.overrides == {"zero_optimization": {"stage": 2}}
    # what the file set and no override touched is kept
    assert recipe.training.lr == 3.0e-3
    assert recipe.model.config == str(RECIPES_DIR / "tiny_llama" / "config.json")


def test_recipe_by_folder_and_by_file(tmp_path):
    assert load_recipe(str(RECIPES_DIR / "tiny_llama")).name == "tiny_llama"
    text = (RECIPES_DIR / "tiny_llama" / "recipe.yaml").read_text().replace(
        "config.json", str(RECIPES_DIR / "tiny_llama" / "config.json"))
    text = text.replace("name_or_path: tokenizer", f"name_or_path: {RECIPES_DIR / 'tiny_llama' / 'tokenizer'}")
    text = text.replace("path: corpus.jsonl", f"path: {RECIPES_DIR / 'tiny_llama' / 'corpus.jsonl'}")
    (tmp_path / "my_run.yaml").write_text(text)
    assert load_recipe(str(tmp_path / "my_run.yaml")).name == "my_run"


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown recipe 'tiny_lama'.*Available recipes: .*tiny_llama"):
        load_recipe("tiny_lama")


def test_mistyped_key_in_the_file_names_key_file_and_suggestion(tmp_path):
    text = (RECIPES_DIR / "tiny_llama" / "recipe.yaml").read_text().replace("warmup_steps:", "warmup_step:")
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("config.json", str(RECIPES_DIR / "tiny_llama" / "config.json")))
    with pytest.raises(ConfigError) as error:
        load_recipe(str(path))
    message = str(error.value)
    assert str(path) in message
    assert "training.warmup_step: unknown key; did you mean 'warmup_steps'?" in message


def test_mistyped_override_names_the_override_and_suggests():
    with pytest.raises(ConfigError) as error:
        load_recipe("tiny_llama", ["trainng.max_steps=3"])
    assert "trainng.max_steps=3" in str(error.value)
    assert "trainng: unknown key; did you mean 'training'?" in str(error.value)


@pytest.mark.parametrize("recipe, override, expected", [
    ("tiny_llama_grpo", "grpo.steps_per_generation=4", "grpo.steps_per_generation: TRL's name, not this schema's: "
                                                       "write grpo.generation_batch_size"),
    ("tiny_llama_grpo", "grpo.use_vllm=true", "grpo.use_vllm: TRL's name, not this schema's: "
                                              "write grpo.generation_engine=vllm"),
    ("tiny_llama_dpo", "dpo.loss_type=ipo", "dpo.loss_type: TRL's name, not this schema's: write dpo.loss"),
    ("tiny_llama_dpo", "dpo.padding_free=true", "dpo.padding_free: TRL's name, not this schema's: write data.packing"),
    ("tiny_llama_grpo", "grpo.generation_kwargs.temperature=0.7", "grpo.generation_kwargs.temperature: TRL's name, "
                                                                  "not this schema's: write grpo.temperature"),
    ("tiny_llama_grpo", "grpo.generation_kwargs.num_beams=4", "each completion is one seeded sample"),
    ("tiny_llama_grpo", "grpo.tools=[search]", "grpo.tools: TRL's name, not this schema's: not built: tool calling"),
])
def test_a_trl_config_name_says_where_it_lives_here(recipe, override, expected):
    """A TRL user's GRPOConfig or DPOConfig name that this schema spells otherwise, or does not build, is answered
    with the setting to write (or why none), not with the nearest valid key."""
    with pytest.raises(ConfigError, match=expected):
        load_recipe(recipe, [override])
    from training.objectives.dpo.spec import DpoSection
    from training.objectives.grpo.spec import GenerationKwargs, GrpoSection
    for section in (DpoSection, GrpoSection, GenerationKwargs):
        assert not set(section.trl_names) & set(section.model_fields)  # each still a name this schema lacks
    from transformers import GenerationConfig
    assert set(GenerationKwargs.model_fields) | set(GenerationKwargs.trl_names) <= set(GenerationConfig().__dict__)


@pytest.mark.slow  # trl takes 5 s to import
def test_the_trl_names_are_trls():
    """Each name the unknown-key error answers for is a field of TRL's GRPOConfig or DPOConfig, or an argument of its
    trainer (trl==1.16.0); and each of their fields beyond transformers' TrainingArguments is a setting here or
    answered (a TRL upgrade that adds one fails here, naming it)."""
    import dataclasses
    import inspect

    from transformers import TrainingArguments
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    from training.objectives.dpo.spec import DpoSection
    from training.objectives.grpo.spec import GrpoSection
    trainer_arguments = {field.name for field in dataclasses.fields(TrainingArguments)}
    for section, config, trainer in ((GrpoSection, GRPOConfig, GRPOTrainer), (DpoSection, DPOConfig, DPOTrainer)):
        fields = {field.name for field in dataclasses.fields(config)}
        assert set(section.trl_names) <= fields | set(inspect.signature(trainer).parameters)
        assert fields - trainer_arguments - set(section.model_fields) - set(section.trl_names) == set()


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        load_recipe("tiny_llama", ["training.lr=fast", "data.seq_len=-1", "precision=fp7"])
    message = str(error.value)
    assert "has 3 problem(s)" in message
    assert "training.lr: Input should be a valid number" in message and "'fast'" in message
    assert "data.seq_len: Input should be greater than 0 (got -1)" in message
    assert "precision: Input should be 'auto', 'bf16', 'fp16', 'fp32' or 'fp8' (got 'fp7')" in message


@pytest.mark.parametrize("override, expected", [
    ("training.epochs=2", "set exactly one of training.max_steps and training.epochs"),
    ("data.sources.0.path=missing.jsonl", "data.sources.0.path: file not found"),
    ("model.config=null", "set model.config .*, model.name_or_path .*, or both"),
    ("oops", "not of the form key.path=value"),
    ("training.lr.value=1", "training.lr is a float, not a mapping"),
    ("long_context.offload_checkpoints=true", "set activation_checkpointing=true"),
])
def test_invalid_overrides(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_recipe("tiny_llama", [override])


def test_unsupported_data_file_type(tmp_path):
    (tmp_path / "data.xml").write_text("<doc/>")
    with pytest.raises(ConfigError, match=r"data.xml: unsupported file type; use one of .jsonl"):
        load_recipe("tiny_llama", [f"data.sources.0.path={tmp_path / 'data.xml'}"])


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{path} is not valid YAML"):
        load_recipe(str(path))


def test_dpo_settings_need_the_dpo_objective():
    with pytest.raises(ConfigError, match="dpo.* is set but training.objective is lm"):
        load_recipe("tiny_llama", ["dpo.beta=0.5"])
    assert (load_recipe("tiny_llama_dpo").data.examples == "pairs"
            and load_recipe("tiny_llama").data.examples == "documents")
