"""What an experiment means for the run, derived in one place and torch-free: the
settings and training arguments a run will use (effective.py), its attention (attention.py),
what this machine can run for the choices `auto` makes (kernels.py), the DeepSpeed config
(deepspeed.py). Imports config's schema and records, and errors."""
