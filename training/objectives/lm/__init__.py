"""training.objective=lm: the next-token loss (spec.py, objective.py)."""
