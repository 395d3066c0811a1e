"""training.objective=dpo: preference tuning against a frozen reference (spec.py: the dpo section; objective.py: the
run; loss.py: the formulas; preference_loss.py: a micro-batch's loss and the metrics; reference_logps.py: the reference
computed before step 1 and stored with the run)."""
