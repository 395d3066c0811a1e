"""Building the model: Hugging Face loading (model.py), the attention kernel and packed rows' masks (attention.py), the
fused head and loss (fused_loss.py), torch.compile (compile.py), LoRA (lora.py), MoE (moe.py), FP8 (fp8.py) and the
long-context memory savers (long_context.py). Its assembly for a run is training/parallel/build.py."""
