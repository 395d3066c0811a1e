"""Building the model: Hugging Face loading, LoRA, MoE, FP8 and long-context changes."""
