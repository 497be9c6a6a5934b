"""Experiment -> the configs that the libraries consume. Torch-free."""
