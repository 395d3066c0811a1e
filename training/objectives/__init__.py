"""Training objectives, each one module (docs/objectives.md): the language model's next-token loss (lm.py) and
preference tuning (dpo.py) and online RL with verifiable rewards (grpo.py), by their name in training.objective (training/config/recipe.py's OBJECTIVES)."""
from training.objectives.base import Objective
from training.objectives.dpo import Dpo
from training.objectives.grpo import Grpo
from training.objectives.lm import LanguageModel

OBJECTIVES: dict[str, type[Objective]] = {"lm": LanguageModel, "dpo": Dpo, "grpo": Grpo}
