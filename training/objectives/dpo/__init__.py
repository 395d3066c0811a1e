"""training.objective=dpo: preference tuning against a frozen reference (spec.py: the dpo section; memory.py: the synced
reference's memory, in the plan; objective.py: the run; loss.py: the formulas; preference_loss.py: a micro-batch's
loss and the metrics; reference_logps.py: the reference computed before step 1 and stored with the run)."""
