"""training/models/moe.py's checks, on the shipped Mixtral config (no weights)."""
import pytest

from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.models.model import load_model_config
from training.models.moe import check_moe, with_router_loss
from training.objectives.dpo.objective import Dpo

DPO = ["training.objective=dpo", "data.packing=bfd", "data.long_documents=truncate"]


def test_dpo_refuses_the_routers_loss_and_takes_it_turned_off():
    recipe = load_recipe("mixtral_8x7b", DPO)
    with pytest.raises(ConfigError, match="set moe.aux_loss_coef=0"):
        Dpo.check(recipe, with_router_loss(load_model_config(recipe.model), recipe.moe))
    recipe = load_recipe("mixtral_8x7b", [*DPO, "moe.aux_loss_coef=0"])
    config = with_router_loss(load_model_config(recipe.model), recipe.moe)
    check_moe(recipe, config)
    Dpo.check(recipe, config)
