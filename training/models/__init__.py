"""Building the model: Hugging Face loading, its assembly for a run, LoRA, MoE, FP8 and long-context changes."""
