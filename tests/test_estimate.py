"""`finetune estimate`: the CLI, its torch-free promise, the model-state bytes checked
exactly against real tensors (tiny llama/qwen2/qwen3 models, peft LoRA/DoRA, bitsandbytes
4- and 8-bit on the CPU), activations against the tensors autograd saves, the bench
configs against transformers, and the ZeRO arithmetic and recommendation on 8B."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import weakref
from dataclasses import replace

import pytest

from conftest import QUICKSTART, REPO, run_cli
from finetune.config import load_experiment
from finetune.config.derived import kernels
from finetune.errors import ConfigError
from finetune.estimate import as_dict, estimate, parse_memory, render_text
from finetune.estimate.census import census
from finetune.estimate.core import GiB, activation_bytes, ladder_layouts
from finetune.estimate.memory import model_states
from finetune.estimate.settings import Layout, settings_of
from finetune.estimate.shapes import parameters, read_shape

# The examples name hub models and data; the estimate reads no network either way.
pytestmark = pytest.mark.usefixtures("online")

BENCH = REPO / "bench" / "models"
QWEN = BENCH / "qwen2.5-0.5b"
LLAMA_8B = BENCH / "llama-3.1-8b"
SFT_LORA = REPO / "configs" / "examples" / "qwen2.5-0.5b-sft-lora.yaml"
SFT = QUICKSTART / "sft.yaml"


def _estimate_json(*args: str, cwd) -> dict:
    result = run_cli("estimate", *args, "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- the command -------------------------------------------------------------------


def test_cli_quickstart_table(tmp_path):
    result = run_cli("estimate", str(SFT), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("model: llama, 569,600 parameters", "full fine-tuning", "per GPU:", "total",
                 "optimizer states (adamw_torch)", "recommendation:", "assumed:",
                 "cheapest setup that fits 1 x 80.0 GiB"):
        assert text in out, text


def test_cli_qwen_lora_json(tmp_path):
    data = _estimate_json(str(SFT_LORA), f"model.name_or_path={QWEN}", "--gpus", "2",
                          "--gpu-memory", "24GB", cwd=tmp_path)
    assert data["model"]["params"] == 494_032_768
    # LoRA r=16 on q,k,v,o,gate,up,down of 24 layers: r * (in + out) each.
    h, kv, i = 896, 128, 4864
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
    assert data["model"]["trainable_params"] == 16 * per_layer * 24
    configured = data["configured"]
    assert configured["layout"] == "ddp" and data["settings"]["gpus"] == 2
    assert configured["bytes"]["weights"] == 494_032_768 * 2       # frozen bf16 base
    assert configured["bytes"]["buffers"] == configured["bytes"]["gradients"]  # DDP buckets
    assert data["gpu_memory_bytes"] == 24 * GiB
    assert data["settings"]["seq_len"] == 2048 and data["settings"]["activation_checkpointing"]
    assert configured["total_bytes"] == sum(configured["bytes"].values()) + \
        configured["fragmentation_bytes"] + configured["cuda_context_bytes"]


@pytest.mark.slow
def test_cli_user_errors_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = run_cli("estimate", str(SFT), "model.name_or_path=nobody/no-such-model", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a local directory" in result.stderr and "model.name_or_path=" in result.stderr
    result = run_cli("estimate", str(SFT), "--gpu-memory", "lots", cwd=tmp_path)
    assert result.returncode == 2 and "--gpu-memory" in result.stderr
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    result = run_cli("estimate", str(SFT), f"model.name_or_path={odd}", cwd=tmp_path)
    assert result.returncode == 2 and "model_type 'gpt2' is not supported" in result.stderr


@pytest.mark.parametrize("change, expected", [
    ({"num_hidden_layers": 10_000_000}, "num_hidden_layers must be an integer in 1..10,000"),
    ({"max_position_embeddings": "abc"}, "max_position_embeddings must be an integer"),
    ({"vocab_size": 10 ** 400}, "vocab_size must be an integer in 1..16,777,216"),
])
def test_absurd_model_configs_are_one_error(tmp_path, change, expected):
    """The estimate walks the model layer by layer: a config.json past any real model is
    refused in a moment instead of hanging or raising."""
    model = tmp_path / "model"
    model.mkdir()
    config = {**json.loads((QWEN / "config.json").read_text()), **change}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=expected):
        estimate(load_experiment(SFT, [f"model.name_or_path={model}", "model.init=pretrained",
                                       "training.max_length=null"]))


def test_a_revision_not_in_the_cache_is_not_another_revision(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((QWEN / "config.json").read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    exp = lambda *extra: load_experiment(SFT_LORA, ["model.name_or_path=org/m", *extra])
    assert estimate(exp()).shape.layers == 24  # newest snapshot, no revision asked for
    assert estimate(exp("model.revision=abc")).shape.layers == 24
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        estimate(exp("model.revision=v2"))


def test_huge_memory_and_sizes_answer_at_once():
    exp = load_experiment(SFT_LORA, [f"model.name_or_path={QWEN}"])
    found = estimate(exp, gpu_memory=parse_memory("1000000GB"))
    assert found.configured.max_micro_batch > 10 ** 5  # ~4 GB a sample, 1 PB of memory
    exp = load_experiment(SFT_LORA, [f"model.name_or_path={QWEN}", "training.max_length=2147483647",
                                     "training.per_device_train_batch_size=2147483647"])
    assert not estimate(exp).configured.fits


@pytest.mark.parametrize("config, model", [
    (SFT_LORA, QWEN),
    # a vision-language model: its config defaults and the VLM types are read from
    # transformers' source, never imported
    (REPO / "configs" / "quickstart" / "vlm.yaml", BENCH / "llava-1.5-7b"),
])
def test_estimate_imports_no_torch(config, model):
    code = ("import sys, io, contextlib\nfrom finetune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['estimate', {str(config)!r}, 'model.name_or_path={model}']) == 0\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'deepspeed', "
            "'bitsandbytes', 'accelerate', 'datasets') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_parse_memory():
    assert parse_memory("80GB") == parse_memory("80GiB") == parse_memory("80") == 80 * GiB
    assert parse_memory("24G") == 24 * GiB and parse_memory("512MiB") == 512 * 2 ** 20
    assert parse_memory("1.5 GB") == int(1.5 * GiB)
    for bad in ("", "GB", "-4GB", "80 parsecs"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_hub_id_read_from_the_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((QWEN / "config.json").read_text())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    shape = read_shape("Qwen/Qwen2.5-0.5B")
    assert shape.source == str(snapshot / "config.json") and shape.vocab == 151936


def test_lora_targets_that_match_nothing_are_an_error():
    experiment = load_experiment(SFT_LORA, [f"model.name_or_path={QWEN}",
                                            "peft.target_modules=[no_such_proj]"])
    with pytest.raises(ConfigError, match="matches no Linear"):
        estimate(experiment)


def test_classify_reads_its_own_max_length():
    # max_length is no field of TrainingArguments (trl_fields raises KeyError for it).
    experiment = load_experiment(QUICKSTART / "classify.yaml")
    est = estimate(experiment)
    assert est.settings.seq_len == experiment.classify.max_length == 16
    assert est.settings.head == "score" and est.settings.num_labels == 3
    assert "training: classify, full fine-tuning" in render_text(est)


# --- the bench configs ---------------------------------------------------------------


@pytest.mark.parametrize("name,count", [("qwen2.5-0.5b", 494_032_768),
                                        ("llama-3.2-1b", 1_235_814_400),
                                        ("llama-3.1-8b", 8_030_261_248)])
def test_bench_configs_build_and_match(name, count):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(BENCH / name)
    shape = read_shape(str(BENCH / name))
    for auto, head in ((AutoModelForCausalLM, "lm"), (AutoModelForSequenceClassification, "score")):
        config.num_labels = 1
        with torch.device("meta"):
            model = auto.from_config(config)
        real = {n: p.numel() for n, p in model.named_parameters()}
        assert real == {p.name: p.numel for p in parameters(shape, head, 1)}
        if head == "lm":
            assert sum(real.values()) == count


# --- model states, exactly, against real tensors --------------------------------------

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, head_dim=16)
TRL_TRAINERS = ("sft", "dpo", "reward", "grpo")

CASES = {  # id: (model, tied, method, peft section)
    "llama-full": ("llama", False, "sft", "type: none"),
    "qwen3-full": ("qwen3", False, "sft", "type: none"),
    "llama-reward-full": ("llama", False, "reward", "type: none"),
    "qwen2-lora-all-linear": ("qwen2", True, "sft", "type: lora\n  r: 4"),
    "llama-lora-list-dora-lm_head": ("llama", False, "sft",
                                     "type: lora\n  r: 4\n  target_modules: [q_proj, v_proj]\n"
                                     "  use_dora: true\n  modules_to_save: [lm_head]"),
    "qwen2-reward-lora-bias": ("qwen2", True, "reward", "type: lora\n  r: 4\n  bias: all"),
    "qwen2-qlora-4bit": ("qwen2", True, "sft", "type: qlora\n  r: 4\n  bias: lora_only"),
    "llama-classify-qlora-4bit-no-dq": ("llama", False, "classify",
                                        "type: qlora\n  r: 4\n  double_quant: false"),
    "llama-qlora-8bit": ("llama", True, "sft", "type: qlora\n  bits: 8\n  r: 4"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    root = tmp_path_factory.mktemp("tiny-models")
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

    def make(kind: str, tied: bool):
        path = root / f"{kind}-{tied}"
        if not path.exists():
            torch.manual_seed(0)
            config = classes[kind](tie_word_embeddings=tied, **TINY)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return path

    return make


def _tiny_experiment(tmp_path, model_dir, method: str, peft: str):
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    classify = "classify:\n  labels: [a, b, c]\n  max_length: 16\n" if method == "classify" else ""
    length = "" if method == "classify" else "  max_length: 16\n"
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: t\nmethod: {method}\nmodel:\n  name_or_path: {model_dir}\n"
                    f"data:\n  train: {tmp_path / 'rows.jsonl'}\n{classify}precision: bf16\n"
                    f"distributed:\n  device: cpu\npeft:\n  {peft}\n"
                    f"training:\n  optim: adamw_torch\n{length}")
    return load_experiment(path)


def _held_bytes(model) -> int:
    """Bytes of every parameter storage and bitsandbytes quantization constant, once each."""
    storages = {}

    def add(tensor):
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for param in model.parameters():
        add(param)
        state = getattr(param, "quant_state", None)  # 4-bit: absmax, code, nested state
        if state is not None:
            add(state.absmax)
            add(state.code)
            add(getattr(state, "offset", None))
            if state.nested:
                add(state.state2.absmax)
                add(state.state2.code)
        add(getattr(param, "SCB", None))  # 8-bit: one fp32 scale per output row
    return sum(storages.values())


@pytest.mark.parametrize("case", list(CASES))
def test_model_states_exact_against_real_tensors(case, tiny_model, tmp_path):
    torch = pytest.importorskip("torch")
    from finetune.model.hardware import Hardware
    from finetune.model.load import load_model
    from finetune.model.peft import apply_peft

    kind, tied, method, peft = CASES[case]
    experiment = _tiny_experiment(tmp_path, tiny_model(kind, tied), method, peft)
    model = load_model(experiment, Hardware("cpu", "bf16"), types.SimpleNamespace(pad_token_id=0),
                       tmp_path, None)
    model = apply_peft(model, experiment, gradient_checkpointing=False)
    if experiment.peft.type == "qlora" and method in TRL_TRAINERS:
        # What TRL's trainers do to a quantized model (trl/trainer/sft_trainer.py and siblings).
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)

    shape = read_shape(experiment.model.name_or_path)
    settings = settings_of(experiment, max_positions=shape.max_positions)
    states = model_states(census(shape, settings), [], settings, Layout("none"))

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert _held_bytes(model) == states.weights + states.trainable
    assert sum(p.numel() * p.element_size() for p in trainable) == states.trainable

    # One training step: the activations autograd keeps, then gradients and AdamW states.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    batch, seq = 2, 16
    ids = torch.randint(1, TINY["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0  # padding: sdpa gets a mask
    inputs = {"input_ids": ids, "attention_mask": mask}
    if method == "sft":
        inputs["labels"] = ids
    if method == "classify":
        inputs["labels"] = torch.zeros(batch, dtype=torch.long)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t,
                                                  lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**inputs)
    loss = out.loss if out.loss is not None else out.logits.float().sum()
    alive = {}
    for ref in saved:
        tensor = ref()
        if tensor is not None and tensor.untyped_storage().data_ptr() not in params:
            alive[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    loss.backward()
    assert sum(p.grad.numel() * p.grad.element_size() for p in trainable) == states.gradients
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    optimizer.step()
    held = sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values())  # exp_avg, exp_avg_sq and the fp32 `step` tensor
    assert held == states.optimizer

    # Activations are an estimate: on the CPU (float dropout masks) it must come within 1%
    # (what is left: the rotary cos/sin tables, one per forward, and a scalar); DoRA 5%.
    # The batch above is padded: sdpa with a padding mask (finetune_varlen, sft's default
    # here, hands padded batches to sdpa), whatever sft's default for flattened rows.
    acts = activation_bytes(shape, settings.with_(device="cpu", attention="sdpa",
                                                  mask="padding"), Layout("none"), False)
    expected = batch * (acts.layers + acts.other + acts.logits_saved) // settings.sequences
    expected += states.autocast + states.dora
    measured = sum(alive.values())
    assert abs(measured - expected) <= (0.05 if "dora" in case else 0.01) * measured, \
        (measured, expected)


# --- ZeRO arithmetic and the recommendation, on Llama-3.1-8B ---------------------------


def _llama8b(*overrides: str):
    return load_experiment(SFT_LORA, [f"model.name_or_path={LLAMA_8B}", *overrides])


def test_zero_arithmetic_full_8b():
    experiment = _llama8b("peft.type=none")
    shape = read_shape(str(LLAMA_8B))
    settings = settings_of(experiment, gpus=8, max_positions=shape.max_positions)
    tensors = census(shape, settings)
    p, n = 8_030_261_248, 8
    count = len(tensors)
    adam = 8 * p + 4 * count  # fp32 exp_avg + exp_avg_sq, and a step tensor each

    def ceil(a):
        return -(-a // n)

    plain = model_states(tensors, [], settings, Layout("ddp"))
    assert (plain.trainable, plain.gradients, plain.buffers) == (4 * p, 4 * p, 4 * p)  # + DDP
    assert plain.optimizer == adam
    linear = sum(t.numel for t in tensors if t.role in ("linear", "head"))
    assert plain.autocast == 2 * linear and plain.weights == plain.master == 0

    z1 = model_states(tensors, [], settings, Layout("deepspeed", 1))
    assert (z1.trainable, z1.gradients, z1.master) == (2 * p, 2 * p, ceil(4 * p))
    assert z1.optimizer == ceil(8 * p + 4 * count) and z1.autocast == 0
    z2 = model_states(tensors, [], settings, Layout("deepspeed", 2))
    assert (z2.trainable, z2.gradients, z2.master) == (2 * p, ceil(2 * p), ceil(4 * p))
    z3 = model_states(tensors, [], settings, Layout("deepspeed", 3))
    assert (z3.trainable, z3.gradients) == (ceil(2 * p), ceil(2 * p))
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096  # + norms
    assert z3.buffers == 2 * max(2 * layer, 128256 * 4096)  # two layers, or the embedding
    off = model_states(tensors, [], settings, Layout("deepspeed", 3, "cpu"))
    assert off.master == off.optimizer == 0
    assert off.cpu == ceil(4 * p) + ceil(adam) + ceil(4 * p)  # master, states, fp32 grads
    both = model_states(tensors, [], settings, Layout("deepspeed", 3, "cpu", "cpu"))
    assert both.trainable == 0 and both.cpu == off.cpu + ceil(2 * p)


def test_tensor_parallel_splits_the_decoder_linears_and_zero_shards_over_the_rest():
    """8 processes = tensor parallel 2 x data parallel 4, bf16 ZeRO-1: each process holds
    half of every decoder linear and all of the embeddings, norms and head; ZeRO-1 shards
    the master weights and optimizer states over the 4 data parallel groups."""
    experiment = _llama8b("peft.type=none", "distributed.strategy=deepspeed",
                          "distributed.num_processes=8", "distributed.tensor_parallel=2",
                          "distributed.deepspeed.zero_stage=1")
    shape = read_shape(str(LLAMA_8B))
    settings = settings_of(experiment, max_positions=shape.max_positions)
    assert settings.layout == Layout("deepspeed", 1, tensor_parallel=2)
    tensors = census(shape, settings)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    held = 8_030_261_248 - 32 * layer // 2  # parameters one process holds
    z1 = model_states(tensors, [], settings, settings.layout)
    assert (z1.trainable, z1.gradients) == (2 * held, 2 * held)
    assert z1.master == -(-4 * held // 4)
    ladder = ladder_layouts(settings)
    assert [(lay.zero_stage, lay.tensor_parallel) for lay in ladder] == [(0, 2), (1, 2), (2, 2)]
    assert "deepspeed ZeRO-1, tensor parallel 2" == settings.layout.label()
    with pytest.raises(ConfigError, match="not a multiple of distributed.tensor_parallel 2"):
        settings_of(experiment, gpus=3)


def test_sequence_parallel_holds_a_slice_of_every_row():
    """Ulysses over 2 processes: each holds half of every row's tokens (the activations of
    a run of half the length), and ZeRO shards over both processes."""
    base = ("peft.type=none", "distributed.strategy=deepspeed", "distributed.num_processes=2",
            "distributed.deepspeed.zero_stage=2", "training.padding_free=false",
            "training.max_length=4096")
    split = estimate(_llama8b(*base, "distributed.sequence_parallel=2"), gpu_memory=80 * GiB)
    half = estimate(_llama8b(*base, "training.max_length=2048"), gpu_memory=80 * GiB)
    assert split.settings.seq_len == 2048
    assert split.configured.per_sample == half.configured.per_sample
    assert split.configured.states == half.configured.states  # ZeRO-2 over both either way
    assert [ev.layout.label() for ev in split.ladder] == [
        "deepspeed ZeRO-1, sequence parallel 2", "deepspeed ZeRO-2, sequence parallel 2"]


def test_recommendation_8b():
    one = estimate(_llama8b("peft.type=none"), gpus=1, gpu_memory=80 * GiB)
    assert not one.configured.fits
    assert [ev.fits for ev in one.ladder[:4]] == [False] * 4  # none, ZeRO-1/2/3 on one GPU
    assert "offload" in one.recommendation[0]
    eight = estimate(_llama8b("peft.type=none"), gpus=8, gpu_memory=80 * GiB)
    assert not eight.ladder[0].fits and eight.ladder[1].fits
    assert "deepspeed ZeRO-1" in eight.recommendation[0]
    assert "distributed.deepspeed.zero_stage=1" in eight.recommendation[2]
    batches = [ev.max_micro_batch for ev in eight.ladder[1:4]]
    assert batches == sorted(batches) and batches[0] >= 4
    lora = estimate(_llama8b(), gpus=1, gpu_memory=80 * GiB)
    assert lora.configured.fits and lora.recommendation[0].startswith(
        "cheapest setup that fits 1 x 80.0 GiB at micro batch 4: none")
    small = estimate(_llama8b("peft.type=none"), gpus=1, gpu_memory=16 * GiB)
    assert small.recommendation[0].startswith("nothing fits 1 x 16.0 GiB")
    data = as_dict(eight)
    assert data["ladder"][1]["layout"] == "deepspeed ZeRO-1" and data["ladder"][1]["fits"]


def test_lower_micro_batch_and_checkpointing_advice():
    # As where liger-kernel is not installed (CI): with it the logits are fused, and these
    # runs fit at other batches (tests/test_gpu_paths.py holds the estimate with Liger).
    plain = replace(kernels.installed(), liger=None)
    lower = estimate(load_experiment(SFT_LORA, [f"model.name_or_path={QWEN}",
                                                "training.per_device_train_batch_size=16"]),
                     gpu_memory=24 * GiB, kernels=plain)
    assert "fits at micro batch" in lower.recommendation[0]
    assert "per_device_train_batch_size=" in lower.recommendation[1]
    best = lower.ladder[0]
    assert best.total_at(best.max_micro_batch) <= 24 * GiB < best.total_at(best.max_micro_batch + 1)
    long = estimate(_llama8b("training.activation_checkpointing=false", "training.max_length=32768",
                             "training.per_device_train_batch_size=1"), gpu_memory=80 * GiB,
                    kernels=plain)
    assert all(ev.max_micro_batch == 0 for ev in long.ladder)
    assert "without activation checkpointing" in long.recommendation[0]
    assert "training.activation_checkpointing=true" in long.recommendation[1]
    qwen = estimate(load_experiment(SFT_LORA, [f"model.name_or_path={QWEN}"]), kernels=plain)
    assert "use_liger_kernel=true" in qwen.recommendation[-1]  # 4 x 2048 x 152k logits


def test_ladders_follow_the_rules():
    qlora = settings_of(_llama8b("peft.type=qlora"))
    assert all(layout.zero_stage < 3 for layout in ladder_layouts(qlora))
    ppo = load_experiment(REPO / "configs" / "examples" / "qwen2.5-0.5b-ppo-lora.yaml",
                          [f"model.name_or_path={QWEN}"])
    assert [layout.strategy for layout in ladder_layouts(settings_of(ppo))] == ["none"]


# --- The run that will happen: finetune's effective settings ---------------------------

LLAMA_1B = BENCH / "llama-3.2-1b"


def _llama1b(*overrides: str):
    return load_experiment(SFT_LORA, [f"model.name_or_path={LLAMA_1B}", "peft.type=none",
                                      "training.max_length=2048", "precision=bf16",
                                      "distributed.device=cuda",
                                      "training.per_device_train_batch_size=8",
                                      "training.activation_checkpointing=auto", *overrides])


def _row(found, key: str) -> int:
    return next(size for k, _, size in found.configured.rows if k == key)


def test_estimate_counts_the_attention_and_loss_the_run_will_use():
    """The settings come from the same training arguments the worker builds: padding-free
    batches on a varlen kernel keep no mask; under sdpa a flattened row keeps a dense one;
    Liger's fused loss never holds the logits."""
    off = "training.activation_checkpointing=false"
    varlen = estimate(_llama1b(off, "model.attn_implementation=finetune_varlen"))
    assert (varlen.settings.attention, varlen.settings.mask) == ("flash", "none")
    padded = estimate(_llama1b(off, "model.attn_implementation=sdpa"))
    assert padded.settings.mask == "padding"  # padding-free is not sdpa's default on a GPU
    dense = estimate(_llama1b(off, "model.attn_implementation=sdpa", "training.padding_free=true"))
    assert dense.settings.mask == "flattened"
    assert _row(varlen, "activations") < _row(padded, "activations") < _row(dense, "activations")
    assert "dense mask over each flattened" in "\n".join(dense.assumptions)

    liger = estimate(_llama1b(off, "training.use_liger_kernel=true"))
    plain = estimate(_llama1b(off, "training.use_liger_kernel=false"))
    assert _row(liger, "logits") == 0 < _row(plain, "logits")
    assert _row(liger, "activations") < _row(plain, "activations")  # RMSNorm, SwiGLU


def test_activation_checkpointing_auto_follows_the_device_memory():
    liger = "training.use_liger_kernel=true"  # as in the H100 run (docs/estimate.md)
    big = estimate(_llama1b(liger), gpu_memory=80 * GiB)
    assert big.settings.checkpointing is False and big.configured.checkpointing is False
    assert big.checkpointing_note.startswith("activation checkpointing off (auto): without it "
                                             "the estimate is")
    assert "within 85% of 80.0 GiB" in big.checkpointing_note
    small = estimate(_llama1b(liger), gpu_memory=24 * GiB)
    assert small.settings.checkpointing is True and small.configured.checkpointing is True
    assert "over 85% of 24.0 GiB" in small.checkpointing_note
    assert big.configured.total > 0.85 * 24 * GiB  # the same run, decided differently
    for value in ("true", "false"):
        chosen = estimate(_llama1b(f"training.activation_checkpointing={value}"),
                          gpu_memory=24 * GiB)
        assert chosen.settings.checkpointing is (value == "true")
        assert chosen.checkpointing_note is None
