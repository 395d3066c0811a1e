"""training.objective=grpo: online RL with verifiable rewards (spec.py: the grpo section; objective.py: the run;
loss.py: the loss types; rewards.py: the reward functions and models)."""
