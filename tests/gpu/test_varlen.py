"""finetune_varlen on a GPU: torch's CUDA varlen kernel really called, against an fp32
reference per sequence (forward and backward; GQA, a sliding window, bf16 weights and fp32
weights under autocast), and a GQA Llama trained padding-free on it against the same rows
padded under sdpa (loss and gradients). tests/test_attention.py proves the glue on the CPU
with the reference kernel; this proves the kernel and its arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from finetune.model import varlen

LENGTHS = [37, 128, 5, 300]


class _Causal(torch.nn.Module):
    is_causal = True


def _reference(q, k, v, window):
    """fp32, one causal (windowed) sdpa per sequence: (1, tokens, heads, dim)."""
    outs, start = [], 0
    for n in LENGTHS:
        qs, ks, vs = (t[:, :, start:start + n].float() for t in (q, k, v))
        mask = varlen._window(n, n, (window - 1 if window else -1, 0), q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                   enable_gqa=True).transpose(1, 2))
        start += n
    return torch.cat(outs, 1)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("weights", ["bf16", "fp32+autocast"])
def test_the_cuda_kernel_matches_a_per_sequence_reference(monkeypatch, window, weights, figures):
    torch_kernel = varlen.KERNELS[0]
    assert torch_kernel.fn is not varlen.reference_kernel, "this torch has no varlen_attn"
    calls = []

    def spy(*args, **kwargs):
        calls.append(sorted(kwargs))
        return torch_kernel.fn(*args, **kwargs)

    monkeypatch.setattr(varlen, "KERNELS", (varlen.Kernel(spy, torch_kernel.parameters),
                                            varlen.KERNELS[-1]))
    torch.manual_seed(0)
    heads, kv_heads, dim, total = 8, 2, 64, sum(LENGTHS)
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    q = torch.randn(1, heads, total, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=dtype, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).cuda()[None]
    with torch.autocast("cuda", torch.bfloat16, enabled=weights != "bf16"):
        out, _ = varlen.varlen_attention(_Causal(), q, k, v, None, position_ids=positions,
                                         sliding_window=window)
    assert calls, "the CUDA varlen kernel was not called"
    grad = torch.randn_like(out, dtype=torch.float32)
    got = torch.autograd.grad(out.float().mul(grad).sum(), (q, k, v))
    ref_out = _reference(q, k, v, window)
    want = torch.autograd.grad(ref_out.mul(grad).sum(), (q, k, v))
    errors = {}
    for name, a, b in (("out", out, ref_out), *zip(("dq", "dk", "dv"), got, want)):
        scale = b.float().abs().max().item()
        errors[name] = (a.float() - b.float()).abs().max().item() / max(scale, 1.0)
        assert errors[name] <= 3e-2, (name, errors[name])  # bf16 rounding, not a wrong mask
    figures(window=window, weights=weights, kernel_kwargs=calls[0],
            worst_relative_error={k: f"{v:.2g}" for k, v in errors.items()})


@pytest.mark.parametrize("weights", ["bf16", "fp32+autocast"])
def test_a_gqa_llama_padding_free_on_varlen_equals_padded_sdpa(weights, figures):
    """The model level: TRL's padding-free batch (cu_seq_lens from the collator) through
    finetune_varlen gives the loss and gradients of the same rows padded under sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    varlen.register()
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 512, (n,)).tolist()} for n in (50, 200, 9)]
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32

    def loss_and_grads(implementation, batch):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config).to("cuda", dtype)
        model.set_attn_implementation(implementation)
        inputs = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items()
                  if k != "seq_idx"}
        with torch.autocast("cuda", torch.bfloat16, enabled=weights != "bf16"):
            loss = model(**inputs).loss
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}

    padded = DataCollatorForLanguageModeling(pad_token_id=0)(rows)
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    assert "cu_seq_lens_q" in flat
    loss_sdpa, grads_sdpa = loss_and_grads("sdpa", padded)
    loss_varlen, grads_varlen = loss_and_grads(varlen.VARLEN, flat)
    worst = max(((grads_sdpa[n] - grads_varlen[n]).norm() / (grads_sdpa[n].norm() + 1e-6)).item()
                for n in grads_sdpa)
    figures(weights=weights, loss_sdpa=round(loss_sdpa, 5), loss_varlen=round(loss_varlen, 5),
            worst_relative_grad_difference=f"{worst:.2g}")
    assert loss_varlen == pytest.approx(loss_sdpa, rel=2e-2)
    assert worst < 0.1
