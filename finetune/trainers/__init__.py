"""Trainer subclasses of our own: weighted losses (weighted.py), classification
(classify.py), PPO (ppo*.py), sft under sequence parallelism (sequence.py). Imports
model, compat and errors."""
