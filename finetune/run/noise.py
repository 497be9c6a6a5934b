"""Library messages that tell a finetune user nothing, hidden at their source before the
libraries load; each filter names the message it hides and says why. Torch-free."""

from __future__ import annotations

import ast
import logging


class _Without(logging.Filter):
    """Drops the records of one logger whose message holds `text`; lets the rest through."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# DeepSpeed is imported by every save and load (accelerate looks for its engine) and, seeing
# no GPU, says "Setting accelerator to CPU. If you have GPU ... unable to detect it": the
# start summary already says which device the run uses, and finetune's device checks
# refuse a CUDA run that finds no GPU.
_CPU_ACCELERATOR = _Without("Setting accelerator to CPU")


def hide_known_noise(quantized: bool = False) -> None:
    """Every command, before the libraries load (cli.main); `finetune train` again once
    its experiment says whether it quantizes."""
    # transformers imports bitsandbytes, which on CPUs with AVX512-BF16 warns at import
    # that a faster 4-bit CPU kernel is not installed: noise where nothing is quantized.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(
        logging.NOTSET if quantized else logging.ERROR)
    logging.getLogger("DeepSpeed").addFilter(_CPU_ACCELERATOR)  # once: the same filter


class _TiedKeysOnResume(logging.Filter):
    """transformers' Trainer says "There were missing keys in the checkpoint model loaded:
    ['lm_head.weight']" on every resume of a model whose output layer shares the input
    embeddings' weight: the checkpoint stores a shared weight once, and loading the other
    fills both. Dropped only where every key it names is one of `tied` (checked to share
    its tensor); any other missing key is still said."""

    PREFIX = "There were missing keys in the checkpoint model loaded: "

    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        try:
            keys = ast.literal_eval(message[len(self.PREFIX):].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(keys, list) and keys and all(
            any(key == t or key.endswith("." + t) for t in self.tied) for key in keys))


def hide_tied_keys_on_resume(tied: set[str]) -> None:
    """tied: the parameter names that share another's tensor (run/worker.py finds them)."""
    if tied:
        logging.getLogger("transformers.trainer").addFilter(_TiedKeysOnResume(tied))
