"""`finetune estimate`: per-GPU memory of an experiment, from config.json arithmetic alone.

Imports no torch, transformers, peft, trl or deepspeed, so it answers in well under a
second. See docs/estimate.md for the formulas, the assumptions and how they were checked.
"""

from finetune.estimate.api import Estimate, estimate
from finetune.estimate.report import as_dict, parse_image_size, parse_memory, render_text

__all__ = ["Estimate", "as_dict", "estimate", "parse_image_size", "parse_memory",
           "render_text"]
