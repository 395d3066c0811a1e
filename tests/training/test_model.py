import pytest

from training.errors import ConfigError
from training.model import check_recipe_against_model, load_model_config
from training.recipe import load_recipe


def test_config_overrides_shrink_the_model():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={num_hidden_layers: 2, hidden_size: 64}"])
    config = load_model_config(recipe.model)
    assert (config.num_hidden_layers, config.hidden_size, config.use_cache) == (2, 64, False)


def test_unknown_config_override_is_an_error():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={num_layers: 2}"])
    with pytest.raises(ConfigError, match="model.config_overrides: num_layers not in LlamaConfig"):
        load_model_config(recipe.model)


def test_seq_len_longer_than_the_model_positions():
    recipe = load_recipe("tiny_llama", ["data.seq_len=2048"])
    with pytest.raises(ConfigError, match="data.seq_len=2048 is longer than the model's max_position_embeddings=1024"):
        check_recipe_against_model(recipe, load_model_config(recipe.model), vocab_size=4096)


def test_tokenizer_larger_than_the_model_vocabulary():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={vocab_size: 1000}"])
    with pytest.raises(ConfigError, match="has 4096 tokens but the model's vocab_size is 1000"):
        check_recipe_against_model(recipe, load_model_config(recipe.model), vocab_size=4096)


def test_unreadable_model_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    recipe = load_recipe("tiny_llama", [f"model.config={tmp_path / 'config.json'}"])
    with pytest.raises(ConfigError, match=f"cannot read a model config from {tmp_path / 'config.json'}"):
        load_model_config(recipe.model)
