"""What a run leaves behind: checkpoints (checkpoint.py; saving.py saves them, in the background or not), the run
state they record (run_state.py), --resume (resume.py), the universal conversion that resumes in another layout
(universal.py), export to Hugging Face folders (export.py), the average of several checkpoints (average.py), the
output folder's rules (output_dir.py) and room on disk for a save (disk_room.py)."""
