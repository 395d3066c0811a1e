"""training.objective=distill: a student learns a teacher's next-token distributions (docs/distill.md). spec.py: the
distill section, before anything is built; memory.py: the teacher's config and what the plan counts of it;
vocabulary.py: the check that the teacher scores the student's tokens; loss.py: the divergence from both models'
hidden states, the forward passes that make them; teacher.py: the frozen teacher beside the student; on_policy.py:
the sampled sequences (lmbda, seq_kd); objective.py: the run (Distill)."""
