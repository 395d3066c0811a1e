"""training.objective=lm before anything is built: the next-token loss has no section of its own."""
from training.objectives.spec import ObjectiveSpec

LM = ObjectiveSpec(name="lm", runtime="training.objectives.lm.objective:LanguageModel",
                   trains_on="packed documents", model_loss=True, rows_per_example=1, unit="rows",
                   examples="documents")
