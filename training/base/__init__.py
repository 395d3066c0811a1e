"""What data_pipeline and every part of training share, below everything else: the user-facing errors and their
exit code (errors.py), the rules every command that writes an output follows (output_guard.py), the base of every
schema section (schema.py), JSON that every reader parses (strict_json.py) and the loading of code a record names as
"module:name" (loader.py)."""
