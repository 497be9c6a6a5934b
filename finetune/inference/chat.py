"""`finetune chat`: a terminal conversation with a run's causal LM through its chat
template, the reply streamed token by token (transformers' TextStreamer).

/reset starts the conversation again (keeping --system), /exit or Ctrl-D ends it, Ctrl-C
stops a reply being written (the turn is dropped) or, at the prompt, ends the chat.

A vision-language model's run takes pictures: `--image PATH` (repeatable) and `/image
PATH` attach them to the next message, where its user turn starts (as LLaMA-Factory's and
TRL's chat CLIs do); the conversation goes through the processor as `finetune generate`'s
prompts do (model/vision.chat_prompts), every picture so far in its turn.
"""

from __future__ import annotations

import sys

import torch

from finetune.data.image_size import fitter
from finetune.errors import DataError, RunError
from finetune.inference.generate import context_of
from finetune.inference.prompts import checked_image
from finetune.model.saved import (device, dtype_of, load_model, load_tokenizer, locate,
                                     require_lm)
from finetune.model.tokenizer import render_chat
from finetune.model.vision import chat_prompts, is_processor, text_tokenizer

HELP = "commands: /reset starts again, /exit (or Ctrl-D) ends the chat"
IMAGE_HELP = "/image PATH attaches a picture to your next message"


class Chat:
    def __init__(self, model, tokenizer, system: str | None, max_new_tokens: int,
                 temperature: float, top_p: float, fit=list):
        self.model, self.fit = model, fit  # fit: vision.max_pixels (data/image_size.py)
        self.processor = tokenizer if is_processor(tokenizer) else None  # takes images
        self.tokenizer = text_tokenizer(tokenizer)
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages, self.images, self.pending = list(self.start), [], []
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def reset(self) -> None:
        self.messages, self.images, self.pending = list(self.start), [], []

    def attach(self, given: str) -> str:
        """A picture for the next message; what to tell the user (a problem is one line,
        and the chat goes on)."""
        if self.processor is None:
            return "/image: the model takes text only (not a vision-language model)"
        if not given:
            return "/image PATH: name the picture"
        try:
            self.pending.append(checked_image(given, "/image"))
        except DataError as exc:
            return str(exc)
        return f"image {len(self.pending)} attached to your next message: {self.pending[-1]}"

    def _encoded(self, messages: list[dict]) -> dict:
        """The conversation as the model's inputs, with a generation prompt."""
        if self.processor is not None:
            return chat_prompts(self.processor, [messages], [self.images + self.pending],
                                self.fit)
        ids = render_chat(self.tokenizer, messages, "the conversation", generation_prompt=True)
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def reply(self, text: str) -> str | None:
        """Stream the answer to `text` (with the pictures attached) and keep both turns;
        None (nothing kept) when the conversation no longer fits the model's context."""
        from transformers import TextStreamer

        content = text if self.processor is None else \
            [*({"type": "image"} for _ in self.pending), {"type": "text", "text": text}]
        messages = [*self.messages, {"role": "user", "content": content}]
        try:
            encoded = self._encoded(messages)
        except DataError as exc:
            print(f"finetune: {exc}", flush=True)
            return None
        length = encoded["input_ids"].shape[1]
        context = context_of(self.model)
        budget = self.max_new_tokens if context is None else \
            min(self.max_new_tokens, context - length)
        if budget <= 0:
            print(f"finetune: the conversation is {length} tokens, the model's context "
                  f"{context}: /reset to start again", flush=True)
            return None
        sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p} \
            if self.temperature > 0 else {"do_sample": False, "temperature": None,
                                          "top_p": None, "top_k": None}
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.no_grad():
            out = self.model.generate(**{k: v.to(self.model.device) for k, v in encoded.items()},
                                      max_new_tokens=budget, streamer=streamer, use_cache=True,
                                      pad_token_id=self.tokenizer.pad_token_id, **sampling)
        answer = self.tokenizer.decode(out[0, length:], skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        self.images, self.pending = self.images + self.pending, []
        return answer


def _turn(chat: Chat) -> bool:
    """One line from the user; False when the chat ends."""
    try:
        line = input("you> ")
    except EOFError:  # Ctrl-D
        print(flush=True)
        return False
    text = line.strip()
    if text in ("/exit", "/quit"):
        return False
    if text == "/reset":
        chat.reset()
        print("finetune: conversation reset", flush=True)
        return True
    if text == "/image" or text.startswith("/image "):
        print(f"finetune: {chat.attach(text[len('/image'):].strip())}", flush=True)
        return True
    if text in ("/help", "/?") or text.startswith("/"):
        print(HELP + (f", {IMAGE_HELP}" if chat.processor is not None else ""), flush=True)
        return True
    if not text:
        return True
    print("assistant> ", end="", flush=True)
    try:
        chat.reply(text)
    except KeyboardInterrupt:  # stop this reply, keep chatting
        print("\nfinetune: reply interrupted (not kept)", flush=True)
    return True


def chat(run_dir: str, *, model_choice: str | None, system: str | None, max_new_tokens: int,
         temperature: float, top_p: float, seed: int, dtype: str,
         images: list[str] | None = None) -> int:
    """images: --image, attached to the first message (a vision-language model's run)."""
    run = locate(run_dir, model_choice)
    require_lm(run, "chat")
    if images and not run.vision:
        raise RunError(f"--image: {run.directory} is not a vision-language model; it takes "
                       "text only")
    for given in images or ():  # checked before the model loads
        checked_image(given, "--image")
    tokenizer = load_tokenizer(run)  # a vision-language model's processor
    if not text_tokenizer(tokenizer).chat_template:
        raise RunError(f"the tokenizer of {run.directory} has no chat template; use `finetune "
                       "generate --raw` for plain-text prompts")
    on = device()
    model = load_model(run, tokenizer, dtype_of(dtype, on), on)
    torch.manual_seed(seed)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    session = Chat(model, tokenizer, system, max_new_tokens, temperature, top_p,
                   fitter(run.experiment))
    for given in images or ():
        print(f"finetune: {session.attach(given)}", flush=True)
    helps = HELP + (f", {IMAGE_HELP}" if session.processor is not None else "")
    print(f"finetune: chatting with {run.directory} on {on}. {helps}", flush=True)
    try:
        while _turn(session):
            pass
    except KeyboardInterrupt:  # Ctrl-C at the prompt
        print(flush=True)
    print("finetune: bye", file=sys.stderr, flush=True)
    return 0
