"""Every training objective, by its name in training.objective: the one registry (docs/objectives.md). It loads
with the recipe's schema, which takes each objective's section from it; the run loads an objective's class
(training/objectives/base.py, objective_class)."""
from training.objectives.distill.spec import DISTILL
from training.objectives.dpo.spec import DPO
from training.objectives.grpo.spec import GRPO
from training.objectives.lm.spec import LM
from training.objectives.spec import ObjectiveSpec

SPECS: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (LM, DPO, GRPO, DISTILL)}
