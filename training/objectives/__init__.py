"""Training objectives, one folder each (docs/objectives.md): lm (the next-token loss), dpo (preference tuning), grpo
(online RL with verifiable rewards) and distill/ (a student on a teacher's next-token distributions). A folder holds
its spec.py (the recipe section, traits and checks, loaded with the recipe's schema), its memory.py where it holds
memory beside the trained model (what the plan counts, named by the spec), its objective.py (the run-time class) and
the modules only it uses; registry.py names them all, base.py is what every objective's class shares, reference.py
the frozen reference model dpo and grpo share (and distill's teacher loads as) and reference_memory.py its memory per
rank. This file imports nothing: the schema loads the specs without the run-time code."""
