"""Experiment -> what the launchers read: the Accelerate YAML (accelerate.py), launch.sh
and job.sbatch (scripts.py), the run bundle (bundle.py), the shipped presets
(presets.py). Torch-free; imports config, rundir and errors, never launch."""
