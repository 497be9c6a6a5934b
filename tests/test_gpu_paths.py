"""The CUDA paths, proven on the CPU with the condition faked: torch 2.10's varlen kernel,
a GPU older than Ampere, a second process's GPU, a flash_attn that does not import, an
offloaded model, a model Liger does not patch, a batch that carries its own cu_seqlens,
FSDP's random init, and the glue under torch.compile. tests/gpu/ runs them for real."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import MINIMAL_SFT, REPO, TINY_MODEL
from test_attention import by_hand
from finetune.model import hardware
from finetune.config import load_experiment
from finetune.config.derived import attention, kernels
from finetune.errors import RunError
from finetune.model import varlen

LLAMA_1B = REPO / "bench" / "models" / "llama-3.2-1b"
QWEN = REPO / "bench" / "models" / "qwen2.5-0.5b"
SFT_LORA = REPO / "configs" / "examples" / "qwen2.5-0.5b-sft-lora.yaml"


@pytest.fixture
def experiment(write):
    def _experiment(*overrides: str):
        return load_experiment(write("exp.yaml", MINIMAL_SFT), list(overrides))
    return _experiment


@pytest.fixture
def fresh_kernels(monkeypatch):
    """config/derived/kernels.py reads the installed packages once per process: read them again."""
    kernels.installed.cache_clear()
    yield
    kernels.installed.cache_clear()


@pytest.fixture
def gpus(monkeypatch, fresh_kernels):
    """torch.cuda as a machine with these GPUs reports it: (name, major, minor) each."""
    def _gpus(*found: tuple[str, int, int]):
        props = [SimpleNamespace(name=name, major=major, minor=minor, total_memory=16 * 2**30)
                 for name, major, minor in found]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props[i])
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda i=0: (props[i].major, props[i].minor))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True:
                            including_emulation or props[0].major >= 8)
    return _gpus


def _causal_module():
    module = torch.nn.Module()
    module.is_causal = True
    return module


def _inputs(lengths, heads=4, kv_heads=2, dim=8, seed=1):
    torch.manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    return q, k, v


# torch 2.10's varlen_attn, word for word in its signature: is_causal, and no scale,
# window_size or enable_gqa (query and key must have as many heads).
TORCH_2_10_SOURCE = '''
def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):
    pass
'''


def test_torch_2_10_varlen_kernel_is_called_as_it_takes(monkeypatch, tmp_path):
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                    return_aux=None):
        assert query.shape[1] == key.shape[1], "torch 2.10 has no grouped-query attention"
        calls.append(is_causal)
        return varlen.reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                       window_size=(-1, 0) if is_causal else (-1, -1))

    stand_in = varlen.Kernel.of(varlen_attn, device_type="cpu", dtypes=None)
    monkeypatch.setattr(varlen, "KERNELS", (stand_in, varlen.KERNELS[-1]))
    lengths = [5, 2, 7]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    q, k, v = _inputs(lengths)
    out, _ = varlen.varlen_attention(_causal_module(), q, k, v, None, scaling=0.3,
                                     position_ids=positions)
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.testing.assert_close(out[0], by_hand(*flat, lengths, 0.3))
    assert calls == [True]  # scale folded into q, kv heads repeated, causal by is_causal
    # A sliding window is more than 2.10's kernel can do: the reference computes it.
    out, _ = varlen.varlen_attention(_causal_module(), q, k, v, None, scaling=0.3,
                                     sliding_window=3, position_ids=positions)
    torch.testing.assert_close(out[0], by_hand(*flat, lengths, 0.3, window=3))
    assert calls == [True]

    # auto reads the same signature from the source, torch-free, and does not pick it.
    source = tmp_path / "varlen.py"
    source.write_text(TORCH_2_10_SOURCE)
    problem = kernels.varlen_problem(kernels.varlen_parameters(source))
    assert "takes no window_size (needs torch 2.11)" in problem
    found = kernels.Kernels(flash_attn=kernels.NOT_INSTALLED, varlen=problem, liger=None)
    name, why = attention.resolve("auto", "cuda", "bf16", True, found)
    assert name is None
    assert why.startswith("torch ") and why.endswith("; flattened batches are padded")
    assert attention.note("auto", name, why).startswith("attention sdpa (auto): torch ")


def test_a_gpu_older_than_ampere_gets_fp16_and_sdpa(gpus, experiment):
    gpus(("Tesla V100-SXM2-16GB", 7, 0))
    hw = hardware.resolve_hardware(experiment("distributed.device=cuda"), {})
    assert hw.precision == "fp16"  # bf16 is only emulated there
    assert hw.notes == ("precision fp16 (auto): Tesla V100-SXM2-16GB has no native bf16 "
                        "(compute capability 7.0)",)
    name, why = attention.resolve("auto", "cuda", hw.precision, True, hw.kernels)
    assert name is None
    assert attention.note("auto", name, why) == (
        "attention sdpa (auto): Tesla V100-SXM2-16GB has compute capability 7.0; flash "
        "attention kernels need 8.0 (Ampere)")
    # Even with flash_attn importable, auto picks no flash kernel there ...
    with_flash = kernels.Kernels(flash_attn=None, varlen=None, liger=None,
                                 gpu="Tesla T4", capability=(7, 5))
    assert attention.resolve("auto", "cuda", "fp16", False, with_flash)[0] is None
    # ... and finetune_varlen set by hand runs its reference kernel on that GPU, said once.
    name, why = attention.resolve(attention.VARLEN, "cuda", "fp16", True, hw.kernels)
    assert name == attention.VARLEN and attention.note(attention.VARLEN, name, why) == (
        "attention finetune_varlen (set): on its reference kernel (one sdpa per sequence, "
        "slow): Tesla V100-SXM2-16GB has compute capability 7.0; flash attention kernels "
        "need 8.0 (Ampere)")
    varlen._flash_devices = None
    try:
        assert varlen.flash_devices() == frozenset()
    finally:
        varlen._flash_devices = None
    # A hand-set bf16 runs emulated (torch allows it); a GPU that cannot is refused.
    assert hardware.resolve_hardware(experiment("distributed.device=cuda", "precision=bf16"),
                                     {}).precision == "bf16"
    torch.cuda.is_bf16_supported = lambda including_emulation=True: False
    with pytest.raises(RunError, match="precision bf16 is not supported by Tesla V100"):
        hardware.resolve_hardware(experiment("distributed.device=cuda", "precision=bf16"), {})


def test_each_process_uses_its_own_gpu(gpus, experiment):
    gpus(("NVIDIA A100-SXM4-80GB", 8, 0), ("NVIDIA A100-SXM4-80GB", 8, 0))
    exp = experiment("distributed.device=cuda", "peft.type=qlora")
    hw = hardware.resolve_hardware(exp, {"LOCAL_RANK": "1", "RANK": "3"})
    assert hw.index == 1 and hw.torch_device == torch.device("cuda", 1)
    assert hw.precision == "bf16" and hw.notes == ()
    from finetune.model.load import quantized_placement

    assert quantized_placement(hw) == {"": 1}  # was {"": 0}: every rank's model on GPU 0
    assert hardware.local_gpu({"LOCAL_RANK": "3"}, 2) == 1
    assert varlen.flash_devices() in (frozenset(), frozenset({0, 1}))  # read once
    varlen._flash_devices = None
    try:
        assert varlen.flash_devices() == frozenset({0, 1})
    finally:
        varlen._flash_devices = None


def test_a_flash_attn_that_does_not_import_is_passed_over(gpus, experiment, monkeypatch,
                                                          tmp_path):
    """A flash_attn built for another torch is found by find_spec and fails on import."""
    package = tmp_path / "site" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    gpus(("NVIDIA H100 80GB HBM3", 9, 0))
    exp = experiment("distributed.device=cuda")
    hw = hardware.resolve_hardware(exp, {})
    assert hw.kernels.flash_attn.startswith(
        "flash_attn is installed but does not import (ImportError: flash_attn_2_cuda.so: "
        "undefined symbol")
    assert kernels.installed().flash_attn is None  # find_spec alone says it is there
    name, why = attention.resolve("auto", "cuda", "bf16", True, hw.kernels)
    assert name == attention.VARLEN
    assert why.startswith("flash_attn is installed but does not import")
    from finetune.model.load import attention_of

    config = SimpleNamespace(model_type="llama")
    with pytest.raises(RunError, match="model.attn_implementation flash_attention_2: "
                                       "flash_attn is installed but does not import"):
        attention_of(experiment("distributed.device=cuda",
                                "model.attn_implementation=flash_attention_2"), hw, config)


def test_exact_match_feeds_the_compute_device_of_an_offloaded_model():
    """FSDP's cpu_offload keeps parameters off the device that computes; accelerate's
    cpu_offload does the same on the CPU (parameters on `meta`, brought in per forward)."""
    from accelerate import cpu_offload
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.run.evaluation import exact_match

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).eval()
    rows = Dataset.from_list([{"prompt": "sort: pear apple", "completion": "apple pear"}] * 3)
    want = exact_match(model, tokenizer, rows, "text", 4, 3, torch.device("cpu"))
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert next(model.parameters()).device.type == "meta"  # where the old code sent inputs
    got = exact_match(model, tokenizer, rows, "text", 4, 3, torch.device("cpu"))
    assert got["examples"] == want["examples"] and got["samples"] == 3


LIGER_SOURCE = '''
def apply_liger_kernel_to_qwen2(**kwargs):
    pass

MODEL_TYPE_TO_APPLY_LIGER_FN = {
    "qwen2": apply_liger_kernel_to_qwen2,
    "mistral": apply_liger_kernel_to_qwen2,
}
'''


@pytest.mark.usefixtures("online")  # the example names a hub dataset; nothing is fetched
def test_the_estimate_counts_logits_for_a_model_liger_does_not_patch(monkeypatch, tmp_path,
                                                                     fresh_kernels):
    """activation_checkpointing auto decides from this estimate: counted as fused where
    Liger leaves the model alone, it turned checkpointing off and the run ran out of memory."""
    from finetune.config.derived.effective import value
    from finetune.estimate import estimate

    site = tmp_path / "site"
    (site / "liger_kernel" / "transformers").mkdir(parents=True)
    (site / "liger_kernel" / "__init__.py").write_text("")
    (site / "liger_kernel" / "transformers" / "__init__.py").write_text("")
    (site / "liger_kernel" / "transformers" / "monkey_patch.py").write_text(LIGER_SOURCE)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "liger_kernel", raising=False)  # a real one imported
    found = kernels.installed()
    assert found.liger == frozenset({"qwen2", "mistral"})

    def run(model, *overrides):
        exp = load_experiment(SFT_LORA, [f"model.name_or_path={model}", "peft.type=none",
                                         "training.max_length=2048", "precision=bf16",
                                         "distributed.device=cuda", *overrides])
        assert value(exp, "use_liger_kernel", "cuda", "bf16", kernels=found) is True
        return estimate(exp, gpu_memory=80 * 2**30, kernels=found)

    llama, qwen = run(LLAMA_1B), run(QWEN)
    logits = {name: next(size for key, _, size in found_.configured.rows if key == "logits")
              for name, found_ in (("llama", llama), ("qwen", qwen))}
    assert qwen.settings.fused_loss and logits["qwen"] == 0
    assert not llama.settings.fused_loss and logits["llama"] > 2**30
    assert "liger-kernel patches no llama model, so the logits are counted" in \
        "\n".join(llama.assumptions)
    assert not any("use_liger_kernel=true" in line for line in llama.recommendation)


def test_a_batch_with_its_own_cu_seqlens_keeps_its_sequences_apart():
    """TRL's padding-free collator hands the model cu_seq_lens_q/k and max_length_q/k; an
    architecture that passes no position_ids to attention still keeps the rows apart."""
    lengths = [5, 2, 7]
    q, k, v = _inputs(lengths)
    cu = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    boundaries = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7,
                  "max_length_k": 7}
    out, _ = varlen.varlen_attention(_causal_module(), q, k, v, None, scaling=0.25,
                                     **boundaries)
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.testing.assert_close(out[0], by_hand(*flat, lengths, 0.25))
    # Negative control: without boundaries the row is one sequence.
    leaky, _ = varlen.varlen_attention(_causal_module(), q, k, v, None, scaling=0.25)
    assert not torch.allclose(leaky[0, 5:7], out[0, 5:7], atol=1e-3)
    # Dropout takes sdpa with the block mask; the same boundaries hold there.
    q, k, v = _inputs(lengths, kv_heads=4)
    torch.manual_seed(3)
    dropped, _ = varlen.varlen_attention(_causal_module(), q, k, v, None, dropout=0.5,
                                         scaling=0.25, **boundaries)
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    allowed = (owner[:, None] == owner[None, :]) & torch.ones(14, 14, dtype=torch.bool).tril()
    torch.manual_seed(3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=0.5, scale=0.25)
    torch.testing.assert_close(dropped, ref.transpose(1, 2))


@pytest.mark.slow  # loads the tiny model three times
def test_fsdp_random_init_is_drawn_once_on_the_cpu(experiment, tmp_path):
    from finetune.model.load import initial_weights, load_model
    from finetune.model.tokenizer import load_tokenizer

    exp = experiment("distributed.device=cuda", "distributed.strategy=fsdp",
                     "distributed.num_processes=2")
    hw = hardware.Hardware(device="cpu", precision="fp32")  # rank 0 draws on the CPU anyway
    tokenizer = load_tokenizer(exp)
    assert initial_weights(exp, hw, tokenizer, tmp_path, seed=3, rank=1) is None
    assert not (tmp_path / "init-model").exists()  # rank 1 drew nothing
    assert initial_weights(exp, hw, tokenizer, tmp_path, seed=3, rank=0) is None  # kept none
    assert (tmp_path / "init-model" / "model.safetensors").is_file()
    loaded = load_model(exp, hw, tokenizer, tmp_path, None)  # every rank, as FSDP shards it
    ddp = experiment("distributed.device=cuda", "distributed.num_processes=2")
    drawn = initial_weights(ddp, hw, tokenizer, tmp_path / "ddp", seed=3, rank=1)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), drawn.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_glue_compiles_without_graph_breaks(monkeypatch):
    """Under torch_compile the glue is traced into the graph: with the collator's
    boundaries, no host sync and no module state. The CPU stands in for the GPU: an opaque
    custom op in place of torch's CUDA kernel, as that one is."""

    @torch.library.custom_op("finetune_test::varlen_attn", mutates_args=())
    def opaque(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
               scale: float | None = None, window_size: list[int] | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        return varlen.reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                       scale=scale, window_size=tuple(window_size),
                                       enable_gqa=enable_gqa)

    @opaque.register_fake
    def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=None,
          enable_gqa=False):
        return torch.empty_like(query)

    kernel = varlen.Kernel(lambda *a, window_size, **kw: opaque(*a, window_size=list(
        window_size), **kw), frozenset({"scale", "window_size", "enable_gqa"}),
        device_type="cpu", dtypes=None)
    monkeypatch.setattr(varlen, "KERNELS", (kernel, varlen.KERNELS[-1]))
    lengths = [5, 2, 7]
    q, k, v = _inputs(lengths)
    cu = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    module = _causal_module()

    def attend(q, k, v, cu):
        return varlen.varlen_attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu,
                                       cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)[0]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(attend)(q, k, v, cu)
    assert explained.graph_break_count == 0, explained.break_reasons
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.testing.assert_close(attend(q, k, v, cu)[0], by_hand(*flat, lengths, 0.25))

    # Control: boundaries read from position_ids need the longest sequence on the host.
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def from_positions(q, k, v, positions):
        return varlen.varlen_attention(module, q, k, v, None, position_ids=positions)[0]

    torch._dynamo.reset()
    assert torch._dynamo.explain(from_positions)(q, k, v, positions).graph_break_count >= 1
