"""finetune_varlen (model/varlen.py), proven on the CPU: the glue that turns a flattened
batch into cu_seqlens runs here with the reference kernel in place of PyTorch's CUDA flash
varlen kernel, and must give what sdpa gives on the same rows padded."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from conftest import DATA, TINY_MODEL, run_cli
from finetune.model import varlen
from finetune.config.derived import attention, kernels

ROWS = [
    {"input_ids": [5, 9, 13, 21, 8, 30, 2], "labels": [-100, -100, 13, 21, 8, 30, 2]},
    {"input_ids": [7, 11, 2], "labels": [-100, 11, 2]},
    {"input_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48, 2],
     "labels": [-100, -100, -100, -100, 44, 45, 46, 47, 48, 2]},
]


@pytest.fixture(scope="module", autouse=True)
def registered():
    varlen.register()


def _model(implementation: str, kv_heads: int = 2):
    """The tiny Llama with grouped-query attention (4 query heads, 2 kv heads)."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.num_key_value_heads = kv_heads
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).float()


def _loss_and_grads(model, batch):
    model.zero_grad()
    inputs = {k: v for k, v in batch.items()
              if k in ("input_ids", "labels", "attention_mask", "position_ids")}
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_padding_free_varlen_equals_sdpa_on_padded_rows():
    padded = DataCollatorForLanguageModeling(pad_token_id=0)(ROWS)
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(ROWS)
    loss_ref, grads_ref = _loss_and_grads(_model("sdpa"), padded)
    loss, grads = _loss_and_grads(_model(attention.VARLEN), flat)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_sequence_attends_to_another():
    model = _model(attention.VARLEN).eval()
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(ROWS)
    with torch.no_grad():
        together = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"],
                         use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0]
                 for r in ROWS]
        # Negative control: without restarting positions the rows are one sequence.
        leaky = model(input_ids=flat["input_ids"], use_cache=False).logits[0]
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)
    second = slice(len(ROWS[0]["input_ids"]), len(ROWS[0]["input_ids"]) + 3)
    assert not torch.allclose(leaky[second], alone[1], atol=1e-3)


def by_hand(q, k, v, lengths, scale, window=None):
    """softmax(q k^T * scale + causal window mask) v per sequence, written out: an
    independent reference for scaling, GQA and the sliding window."""
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (t[start:start + n] for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = (j <= i) & ((j > i - window) if window else True)
        scores = scores.masked_fill(~visible, -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 3])
def test_glue_honours_scale_gqa_and_sliding_window(window):
    torch.manual_seed(1)
    lengths = [5, 2, 7]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    q = torch.randn(1, 4, sum(lengths), 8)
    k, v = torch.randn(1, 2, sum(lengths), 8), torch.randn(1, 2, sum(lengths), 8)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = varlen.varlen_attention(module, q, k, v, None, scaling=0.3,
                                     sliding_window=window, position_ids=positions)
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.testing.assert_close(out[0], by_hand(*flat, lengths, 0.3, window))


def test_padded_batches_and_cached_decoding_match_sdpa():
    """The inputs the varlen path leaves to sdpa: a left-padded batch, then decoding
    step by step from a KV cache (fewer queries than keys)."""
    ids = torch.tensor([[0, 0, 5, 9, 13], [7, 11, 2, 4, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    results = []
    for implementation in ("sdpa", attention.VARLEN):
        model = _model(implementation).eval()
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=mask).logits
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                 do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        results.append((full, torch.stack(out.logits)))
    (full_ref, steps_ref), (full, steps) = results
    valid = mask.bool()
    torch.testing.assert_close(full[valid], full_ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps, steps_ref, rtol=1e-5, atol=1e-5)


def test_dropout_is_applied_as_sdpa_applies_it():
    """The flash varlen kernel has no dropout: with dropout the function takes sdpa with the
    block mask, and the same seed gives sdpa's numbers."""
    torch.manual_seed(2)
    lengths = [4, 6]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    torch.manual_seed(3)
    out, _ = varlen.varlen_attention(module, q, k, v, None, dropout=0.5, scaling=0.25,
                                     position_ids=positions)
    owner = torch.tensor([0] * 4 + [1] * 6)
    allowed = (owner[:, None] == owner[None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    torch.manual_seed(3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                           dropout_p=0.5, scale=0.25)
    torch.testing.assert_close(out, ref.transpose(1, 2))
    no_dropout, _ = varlen.varlen_attention(module, q, k, v, None, scaling=0.25,
                                            position_ids=positions)
    assert not torch.allclose(out, no_dropout)


def test_reference_kernel_takes_what_torch_varlen_takes():
    """On CUDA the glue calls torch.nn.attention.varlen.varlen_attn with the arguments
    the CPU tests give the reference kernel (this torch's takes all of them)."""
    from torch.nn.attention.varlen import varlen_attn

    ours = inspect.signature(varlen.reference_kernel).parameters
    theirs = inspect.signature(varlen_attn).parameters
    assert set(ours) <= set(theirs)
    assert [p for p in ours][:7] == [p for p in theirs][:7]
    torch_kernel, reference = varlen.KERNELS
    assert torch_kernel.fn is varlen_attn and torch_kernel.device_type == "cuda"
    assert {"window_size", "scale", "enable_gqa"} <= torch_kernel.parameters
    assert reference.fn is varlen.reference_kernel and reference.device_type is None
    # What config/derived/kernels.py reads from the source without importing torch is the same.
    assert kernels.installed().varlen is None
    assert kernels.varlen_parameters(kernels._torch_varlen()) == frozenset(theirs)


def test_names_are_what_transformers_accepts():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    installed = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()} - {attention.VARLEN}
    assert installed == set(attention.TRANSFORMERS_NAMES)
    for name in (*attention.NAMES, "kernels-community/flash-attn2",
                 "kernels-community/vllm-flash-attn3@main:flash_attn_func"):
        assert attention.check_name(name) is None, name
    for name in ("flash_attention", "sdpa ", "a/b/c", "spda", ""):
        assert attention.check_name(name), name


def test_auto_resolution_by_device():
    usable = kernels.Kernels(flash_attn=kernels.NOT_INSTALLED, varlen=None, liger=None)

    def resolve(*args, found=usable):
        return attention.resolve(*args, found)

    assert resolve("auto", "cpu", "fp32", True) == (attention.VARLEN, None)  # reference
    assert resolve("auto", "cpu", "fp32", False) == (None, None)
    assert resolve("auto", "cuda", "fp32", True) == (None, None)  # flash needs 16 bits
    assert resolve("auto", "cuda", "bf16", True) == (attention.VARLEN, None)
    assert resolve("auto", "cuda", "bf16", False) == (None, None)
    flash = kernels.Kernels(flash_attn=None, varlen=None, liger=None, capability=(9, 0))
    assert resolve("auto", "cuda", "fp16", False, found=flash) == ("flash_attention_2", None)
    assert resolve("eager", "cuda", "bf16", True) == ("eager", None)
    assert attention.runs_varlen(attention.VARLEN) and not attention.runs_varlen("sdpa")
    assert not attention.runs_varlen(None)


@pytest.mark.slow
def test_training_with_varlen_matches_sdpa(write, tmp_path):
    """The worker registers the function before it builds the model: the CLI trains the
    same losses under finetune_varlen as under sdpa (padding-free batches, CPU)."""
    losses = {}
    for implementation in ("sdpa", attention.VARLEN):
        config = write(f"{implementation}.yaml", (
            f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random, "
            f"attn_implementation: {implementation}}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n"
            "evaluation: {before_training: false}\noutput: {plot: false, save_final: false}\n"
            "training: {max_steps: 3, per_device_train_batch_size: 4, logging_steps: 1, "
            "save_strategy: 'no', seed: 5, padding_free: true}\n"))
        result = run_cli("train", str(config), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"attention {implementation}" in result.stdout
        records = (tmp_path / "runs" / implementation / "metrics.jsonl").read_text()
        losses[implementation] = [json.loads(r)["loss"] for r in records.splitlines()
                                  if '"loss"' in r]
    assert len(losses["sdpa"]) == 3
    assert losses[attention.VARLEN] == pytest.approx(losses["sdpa"], rel=1e-5)
