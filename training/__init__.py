"""Library code behind train.py: recipes, DeepSpeed configs, model building, metrics, checkpoints."""
