"""training.objective=dpo: preference tuning against a frozen reference (spec.py: the dpo section; objective.py)."""
