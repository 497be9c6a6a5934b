"""Library messages that tell a finetune user nothing, hidden at their source before the
libraries load; each filter names the message it hides and says why. Torch-free."""

from __future__ import annotations

import logging


class _Without(logging.Filter):
    """Drops the records of one logger whose message holds `text`; lets the rest through."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def hide_known_noise(quantized: bool) -> None:
    if not quantized:
        # transformers imports bitsandbytes, which on CPUs with AVX512-BF16 warns at import
        # that a faster 4-bit CPU kernel is not installed: noise in a run that quantizes
        # nothing.
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # DeepSpeed is imported by every save (accelerate looks for its engine) and, seeing no
    # GPU, says "Setting accelerator to CPU. If you have GPU ... unable to detect it": the
    # start summary already says which device the run uses, and finetune's device checks
    # refuse a CUDA run that finds no GPU.
    logging.getLogger("DeepSpeed").addFilter(_Without("Setting accelerator to CPU"))
