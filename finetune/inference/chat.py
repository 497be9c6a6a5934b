"""`finetune chat`: a terminal conversation with a run's causal LM through its chat
template, the reply streamed token by token (transformers' TextStreamer).

/reset starts the conversation again (keeping --system), /exit or Ctrl-D ends it, Ctrl-C
stops a reply being written (the turn is dropped) or, at the prompt, ends the chat.
"""

from __future__ import annotations

import sys

import torch

from finetune.errors import DataError, RunError
from finetune.inference.generate import context_of
from finetune.model.saved import (device, dtype_of, load_model, load_tokenizer, locate,
                                     require_lm, require_text_model)
from finetune.model.tokenizer import render_chat

HELP = "commands: /reset starts again, /exit (or Ctrl-D) ends the chat"


class Chat:
    def __init__(self, model, tokenizer, system: str | None, max_new_tokens: int,
                 temperature: float, top_p: float):
        self.model, self.tokenizer = model, tokenizer
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def reset(self) -> None:
        self.messages = list(self.start)

    def reply(self, text: str) -> str | None:
        """Stream the answer to `text` and keep both turns; None (nothing kept) when the
        conversation no longer fits the model's context."""
        from transformers import TextStreamer

        messages = [*self.messages, {"role": "user", "content": text}]
        try:
            ids = render_chat(self.tokenizer, messages, "the conversation", generation_prompt=True)
        except DataError as exc:
            print(f"finetune: {exc}", flush=True)
            return None
        context = context_of(self.model)
        budget = self.max_new_tokens if context is None else \
            min(self.max_new_tokens, context - len(ids))
        if budget <= 0:
            print(f"finetune: the conversation is {len(ids)} tokens, the model's context "
                  f"{context}: /reset to start again", flush=True)
            return None
        sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p} \
            if self.temperature > 0 else {"do_sample": False, "temperature": None,
                                          "top_p": None, "top_k": None}
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        input_ids = torch.tensor([ids], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids,
                                      attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=budget, streamer=streamer, use_cache=True,
                                      pad_token_id=self.tokenizer.pad_token_id, **sampling)
        answer = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
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
    if text in ("/help", "/?") or text.startswith("/"):
        print(HELP, flush=True)
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
         temperature: float, top_p: float, seed: int, dtype: str) -> int:
    run = locate(run_dir, model_choice)
    require_lm(run, "chat")
    require_text_model(run, "chat")
    tokenizer = load_tokenizer(run)
    if not tokenizer.chat_template:
        raise RunError(f"the tokenizer of {run.directory} has no chat template; use `finetune "
                       "generate --raw` for plain-text prompts")
    on = device()
    model = load_model(run, tokenizer, dtype_of(dtype, on), on)
    torch.manual_seed(seed)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    session = Chat(model, tokenizer, system, max_new_tokens, temperature, top_p)
    print(f"finetune: chatting with {run.directory} on {on}. {HELP}", flush=True)
    try:
        while _turn(session):
            pass
    except KeyboardInterrupt:  # Ctrl-C at the prompt
        print(flush=True)
    print("finetune: bye", file=sys.stderr, flush=True)
    return 0
