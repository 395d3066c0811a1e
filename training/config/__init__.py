"""The recipe: its schema, loaded from YAML with `key.path=value` overrides and validated once (recipe.py), the
overrides' parsing (overrides.py) and the validation errors' text (problems.py). The DeepSpeed config and its
automatic choice are made at plan time (training/planning/)."""
