"""Experiment configuration: typed schema, YAML loading, cross-field rules. Torch-free."""

from finetune.config.load import load_experiment
from finetune.config.schema import Experiment

__all__ = ["Experiment", "load_experiment"]
