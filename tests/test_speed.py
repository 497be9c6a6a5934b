"""Padding-free batches (finetune's sft default) compute the same loss and gradients as
padded ones, and no row attends to another: transformers turns the restarting
position_ids of a flattened batch into a block-diagonal mask. It does so only without a
KV cache, as in training (the Trainer and TRL pass use_cache=False); these tests do too."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from conftest import TINY_MODEL

ROWS = [
    {"input_ids": [5, 9, 13, 21, 8, 30, 2], "labels": [-100, -100, 13, 21, 8, 30, 2]},
    {"input_ids": [7, 11, 2], "labels": [-100, 11, 2]},
    {"input_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48, 2],
     "labels": [-100, -100, -100, -100, 44, 45, 46, 47, 48, 2]},
]


def _model():
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _loss_and_grads(model, batch):
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask",
                                                     "position_ids")}
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_padding_free_loss_and_gradients_equal_padded():
    model = _model()
    padded = DataCollatorForLanguageModeling(pad_token_id=0)(ROWS)
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(ROWS)
    assert padded["input_ids"].shape == (3, 10) and flat["input_ids"].shape == (1, 20)
    loss_padded, grads_padded = _loss_and_grads(model, padded)
    loss_flat, grads_flat = _loss_and_grads(model, flat)
    torch.testing.assert_close(loss_flat, loss_padded, rtol=1e-5, atol=0)
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_flat[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_row_attends_to_another():
    model = _model().eval()
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(ROWS)
    with torch.no_grad():
        together = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"],
                         use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0]
                 for r in ROWS]
        # The same tokens concatenated without restarting positions do see each other:
        # the comparison above can tell.
        leaky = model(input_ids=flat["input_ids"], use_cache=False).logits[0]
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)
    second = slice(len(ROWS[0]["input_ids"]), len(ROWS[0]["input_ids"]) + 3)
    assert not torch.allclose(leaky[second], alone[1], atol=1e-3)
