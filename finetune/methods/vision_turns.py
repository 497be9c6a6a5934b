"""Which tokens of a conversation with pictures are the assistant's, for assistant-only
sft of a vision-language model (training.assistant_only_loss, on by default for
conversations). TRL's vision collator masks by the chat template's {% generation %}
markers, and a hub checkpoint's template carries none as a rule. So, as TRL's
SFTTrainer decides it:
- a template with the markers is used as it is;
- one TRL 1.16 ships a training version of (model/chat_template.training_version:
  Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's, SmolVLM's, Idefics3's, Gemma 3's, LLaVA-NeXT's)
  through that version; the measures taken while preparing and `finetune data` use it too;
- any other is split as finetune splits text conversations (data/sft_tokens.py): the
  tokens between "messages up to turn i with the generation prompt" and "messages through
  turn i" are turn i's (each rendered through the processor with its pictures, or, for
  a turn after the last picture, from the text: _boundary). The spans are found once,
  while the data are prepared (the SPANS column), and TurnsTrained keeps the labels
  inside them; TRL's collator then trains every token it is given."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data.rows import SPANS
from finetune.errors import DataError

__all__ = ["SPANS", "Turns", "TurnsTrained", "rendered_ids", "spans", "turns_of"]


@dataclass(frozen=True)
class Turns:
    """How a processor's chat template shows the assistant's turns: by TRL's markers in
    `template` (None: the processor's own template), or by_prefixes."""
    template: str | None = None
    by_prefixes: bool = False


def turns_of(processor) -> Turns:
    from trl.chat_template_utils import has_generation_markers

    from finetune.model.chat_template import training_version

    own = processor.chat_template
    if not own or has_generation_markers(own):  # none: model/tokenizer.py says so
        return Turns()
    version = training_version(processor)
    return Turns(template=version) if version else Turns(by_prefixes=True)


def rendered_ids(processor, rendered: list[dict], generation_prompt: bool = False,
                 template: str | None = None, assistant_mask: bool = False) -> dict:
    """One conversation (images in its parts: model/vision.with_images) through the
    processor as TRL's collator renders it, uncut."""
    return processor.apply_chat_template(
        [rendered], tokenize=True, return_dict=True, chat_template=template,
        add_generation_prompt=generation_prompt, return_assistant_tokens_mask=assistant_mask,
        processor_kwargs={"add_special_tokens": False})


def spans(processor, rendered: list[dict], ids: list[int], where: str) -> list[list[int]]:
    """Each assistant turn's [start, end) in `ids` (the whole conversation's tokens)."""
    whole = _text(processor, rendered, False)
    out = []
    for i, message in enumerate(rendered):
        if message["role"] != "assistant":
            continue
        start = _boundary(processor, rendered[:i], True, whole, ids) if i else 0
        end = _boundary(processor, rendered[: i + 1], False, whole, ids)
        if start is None or end is None:
            raise DataError(f"{where}: the chat template does not render this conversation "
                            "turn by turn (a prefix renders differently) and has no "
                            "{% generation %} markers, so its assistant turns cannot be "
                            "located for assistant_only_loss (on by default for "
                            "conversations); give a template that does, or one with the "
                            "markers (tokenizer.chat_template), or set "
                            "training.assistant_only_loss: false to train on every turn")
        out.append([start, end])
    return out


def _boundary(processor, head: list[dict], generation_prompt: bool, whole: str,
              ids: list[int]) -> int | None:
    """Where `head` (the first messages, rendered with or without the generation prompt)
    ends in `ids`; None where its rendering is no prefix of the whole. Found from the end
    where the text after it, tokenized alone, is the tail of `ids` (no picture after it,
    no token merged across it): that spares putting the pictures through the processor
    again (tens of ms a photo); else from the start, `head` with its pictures."""
    text = _text(processor, head, generation_prompt)
    if not whole.startswith(text):
        return None
    rest = processor.tokenizer(whole[len(text):], add_special_tokens=False)["input_ids"]
    if len(rest) <= len(ids) and ids[len(ids) - len(rest):] == rest:
        return len(ids) - len(rest)
    prefix = _ids(processor, head, generation_prompt)
    return len(prefix) if ids[:len(prefix)] == prefix else None


def _text(processor, rendered: list[dict], generation_prompt: bool) -> str:
    text = processor.apply_chat_template([rendered], tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return text if isinstance(text, str) else text[0]


def _ids(processor, rendered: list[dict], generation_prompt: bool) -> list[int]:
    return list(rendered_ids(processor, rendered, generation_prompt)["input_ids"][0])


class TurnsTrained:
    """A vision collator (TRL's, training every token) whose labels keep each row's
    assistant spans (SPANS) only."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, rows):
        import torch

        batch = self.collate(rows)
        labels = batch["labels"]
        inside = torch.zeros_like(labels, dtype=torch.bool)
        for i, row in enumerate(rows):
            for start, end in row[SPANS]:
                inside[i, start:end] = True
        labels[~inside] = -100
        return batch
