"""The recipe: its schema, loaded from YAML with `key.path=value` overrides and validated once (recipe.py). The
DeepSpeed config and its automatic choice are made at plan time (training/planning/)."""
