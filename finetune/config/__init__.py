"""The experiment: its typed schema (schema.py, section.py, method_sections.py), YAML
loading with extends and overrides (load.py, yamltext.py, paths.py, inputs.py: which
settings name files), the method records (methods.py), TRL's config fields
(trl_fields.py), the experiment reference (reference.py); the rules between fields in
rules/ and the settings derived for a run in derived/. Torch-free; imports only errors."""

from finetune.config.load import load_experiment
from finetune.config.schema import Experiment

__all__ = ["Experiment", "load_experiment"]
