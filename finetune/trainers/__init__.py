"""Trainer subclasses of our own: weighted losses, classification, PPO."""
