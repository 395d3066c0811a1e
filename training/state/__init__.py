"""What a run leaves behind: checkpoints, the run state, resume, universal conversion, export, the output folder's
rules."""
