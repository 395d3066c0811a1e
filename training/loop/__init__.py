"""The training loop's parts: the DeepSpeed engine (engine.py), the optimizer and schedule (optimizer.py;
shaped_optimizer.py: the memory-lean ones under ZeRO), what a run reports (metrics.py) and W&B and MLflow beside it
(trackers.py), the weights' health signals (health.py), evaluation (evaluation.py), lm-eval benchmarks
(benchmarks.py) and the stability guard (stability.py)."""
