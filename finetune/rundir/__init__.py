"""The run directory and what lets a run continue: its paths and files (paths.py), sealed
checkpoints (checkpoints.py), finetune's own state in a checkpoint (checkpoint_state.py),
what a checkpoint's training depended on (fingerprint.py), where a run starts and whether
that is safe (resume.py). Torch-free: imports config, data.files, fileio and errors."""
