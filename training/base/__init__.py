"""What data_pipeline and every part of training share, below everything else: the user-facing errors and their
exit code (errors.py), and the rules every command that writes an output follows (output_guard.py)."""
