"""training.objective=grpo: online RL with verifiable rewards. spec.py: the grpo section, before anything is built;
memory.py: what the plan counts beside the model (a generation's memory, the reward models, the reference);
objective.py: the run (Grpo); sampling.py: a completion's seeded sampling and generate; rollout.py: the completions as
the model's rows and their log-probabilities; settings.py: what the section's settings make (the loss's settings,
steps per generation); loss.py: the loss types; rewards.py: the reward functions and models; logs.py: a generation's
metrics and completions.jsonl; report.py: the dry run's lines and the console's; vllm_engine.py: generation by a vLLM
server (started from its own environment, or one already running), the weights pushed to it every step; vllm_shim/:
what that server's interpreter imports first."""
