"""What a run leaves behind: checkpoints, universal conversion, export, the output folder's rules."""
