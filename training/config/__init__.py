"""The recipe: its schema, loaded from YAML with `key.path=value` overrides and validated once (recipe.py), its
sections (sections.py) and the checks that read several (cross_checks.py), the overrides' parsing (overrides.py),
the validation errors' text (problems.py) and its precision's values (precision.py); and the decoder families, one
record each of what the code reads about a transformers model type (families.py), and the optimizers, one record
each of what the code reads about an update rule (optimizers.py). The DeepSpeed config and its automatic choice are
made at plan time (training/planning/)."""
