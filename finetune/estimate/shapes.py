"""Model shapes from a config.json, read as JSON: the estimator must not import torch.

The parameter list mirrors what transformers builds for llama, mistral, qwen2, qwen3, the
Gemmas, Qwen3.5's hybrid language model (linear_attention.py), the Qwen3 mixtures of
experts (moe.py), and for the vision-language models of vision/ (their language model, a
vision tower and a projector), names included, so a test can compare tensor by tensor;
other architectures are refused rather than guessed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune.config.vision import image_text_model_types
from finetune.errors import ConfigError
from finetune.estimate import cross_attention, linear_attention, moe, vision
from finetune.estimate.defaults import with_defaults
from finetune.estimate.param import Param

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
             "qwen3_5_text", "qwen3_moe", "qwen3_5_moe_text")
# Gemma's decoders (transformers models/gemma, gemma2, gemma3): Gemma's RMSNorm (x * (1 + w),
# in fp32) and a GELU-tanh MLP; Gemma 2 and 3 add a norm after attention and after the MLP
# (sandwich norms), Gemma 3 q/k norms. Their config classes' head_dim (256) is not
# hidden // heads: read with the class's defaults.
GEMMA = {"gemma": ("gemma/configuration_gemma.py", "GemmaConfig"),
         "gemma2": ("gemma2/configuration_gemma2.py", "Gemma2Config"),
         "gemma3_text": ("gemma3/configuration_gemma3.py", "Gemma3TextConfig")}


@dataclass(frozen=True)
class Shape:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool          # qwen3, gemma3: RMSNorm over head_dim on q and k
    max_positions: int | None
    source: str            # the config.json read
    vision: Any = None    # a vision-language model's tower and projector (vision/)
    prefix: str = "model."             # where the language model's modules are
    gemma: bool = False                # Gemma's RMSNorm and MLP (GEMMA)
    sandwich: bool = False             # Gemma 2/3: norms after attention and the MLP too
    logit_softcap: bool = False        # Gemma 2: logits = cap * tanh(logits / cap)
    attn_softcap: bool = False         # Gemma 2: the attention scores are capped so too
    cross_layers: tuple[int, ...] = ()  # mllama: cross-attention layers (cross_attention.py)
    extra_embeddings: int = 0          # mllama: embed_tokens rows past the vocabulary
    linear_layers: tuple[int, ...] = ()  # qwen3_5: Gated DeltaNet layers (linear_attention.py)
    delta: Any = None                  # qwen3_5: their sizes (linear_attention.DeltaNet)
    attn_gate: bool = False            # qwen3_5: q_proj also makes the output's sigmoid gate
    moe: Any = None                    # qwen3_moe: the experts' sizes (moe.Experts)

    @property
    def image_tokens(self) -> int:
        """Tokens one image becomes in the sequence (0: a text model)."""
        return self.vision.image_tokens if self.vision else 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Linear:
    """An nn.Linear (or the embedding, kind 'embedding') of the model, by module name."""
    name: str
    inp: int
    out: int
    bias: bool
    kind: str  # 'layer' (inside a decoder layer), 'head' (lm_head / score), 'embedding'


def _hub_cache() -> Path:
    # The Hugging Face hub's own documented variables, read the way huggingface_hub reads them.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _cached_config(hub_id: str, revision: str | None) -> Path | None:
    repo = _hub_cache() / ("models--" + hub_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    try:
        ref = repo / "refs" / (revision or "main")
        if ref.is_file():
            found = snapshots / ref.read_text().strip() / "config.json"
            if found.is_file():
                return found
        if revision and (snapshots / revision / "config.json").is_file():
            return snapshots / revision / "config.json"
        if revision:
            return None  # another revision's shapes would be an estimate of another model
        candidates = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    except (OSError, ValueError):  # a revision no file name can be, an unreadable cache
        return None
    return candidates[-1] if candidates else None


def find_config(name_or_path: str, revision: str | None = None) -> Path:
    """config.json of a local model directory, else of the hub id in the local HF cache."""
    local = Path(name_or_path)
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise ConfigError([f"model.name_or_path: {local} has no config.json"])
        return path
    found = _cached_config(name_or_path, revision) if name_or_path.count("/") == 1 else None
    if found is None:
        raise ConfigError([
            f"model.name_or_path: {name_or_path!r} is not a local directory and its config.json "
            f"is not in the Hugging Face cache ({_hub_cache()}); the estimator reads no network. "
            f"Pass a local model directory, e.g. `finetune estimate CONFIG "
            f"model.name_or_path=/path/to/model`"])
    return found


# Far past any model (the largest have ~200 layers and ~256k vocabularies): a config
# beyond them is not one the estimate can walk layer by layer in a moment.
LIMITS = {"num_hidden_layers": 10_000, "vocab_size": 2**24}
LIMIT = 2**24  # other sizes (hidden, heads, positions...)


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    limit = LIMITS.get(key, LIMIT)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise ConfigError([f"{where}: {key} must be an integer in 1..{limit:,}, "
                           f"got {str(value)[:40]}"])
    return value


def shape_of(config: dict[str, Any], where: str,
             processor: dict[str, Any] | None = None) -> Shape:
    """processor: a vision-language model's image processor settings (_processor_config)."""
    kind = config.get("model_type")
    if kind in vision.COUNTED:
        text, tower = vision.read(config, where, processor)
        language = vision.language(kind, shape_of(text, where), tower)
        return replace(language, model_type=kind, vision=tower, prefix=vision.text_prefix(kind))
    if kind in image_text_model_types():
        raise ConfigError([f"{where}: model_type {kind!r} is a vision-language model the "
                           f"estimator does not count yet (it counts "
                           f"{', '.join(vision.COUNTED)}: docs/estimate.md)"])
    if kind not in SUPPORTED and kind not in moe.CONFIG:
        raise ConfigError([f"{where}: model_type {kind!r} is not supported by the estimator "
                           f"(supported: {', '.join(SUPPORTED)})"])
    if kind in GEMMA:
        config = with_defaults(config, *GEMMA[kind])
    if kind == "qwen3_5_text":
        config = with_defaults(config, *linear_attention.CONFIG)
    sparse = kind in moe.CONFIG  # a VLM's language model comes as its text type
    if sparse:
        config = with_defaults(config, *moe.CONFIG[kind])
        kind = moe.TEXT_KIND.get(kind, kind)
    hidden = _int(config, "hidden_size", where)
    heads = _int(config, "num_attention_heads", where)
    kv_heads = _int(config, "num_key_value_heads", where, default=heads)
    # llama/qwen read head_dim with getattr(..., hidden // heads); mistral also replaces null.
    head_dim = config.get("head_dim") or hidden // heads
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = {"qwen2": True, "mistral": False}.get(kind, attention_bias)
    o_bias = {"qwen2": False, "mistral": False}.get(kind, attention_bias)
    layers = _int(config, "num_hidden_layers", where)
    hybrid = kind in ("qwen3_5_text", moe.SHARED)
    linear, delta = linear_attention.read(config, layers, where, _int) if hybrid else ((), None)
    return Shape(
        model_type=kind, hidden=hidden,  # Qwen3.5-MoE has no dense MLP (moe.SHARED)
        intermediate=_int(config, "intermediate_size", where) if kind != moe.SHARED else 0,
        layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=_int({"head_dim": head_dim}, "head_dim", where),
        vocab=_int(config, "vocab_size", where),
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=kind == "llama" and bool(config.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe") or hybrid, gemma=kind in GEMMA or hybrid,
        sandwich=kind in ("gemma2", "gemma3_text"),
        logit_softcap=kind in GEMMA and config.get("final_logit_softcapping") is not None,
        attn_softcap=kind in GEMMA and config.get("attn_logit_softcapping") is not None,
        max_positions=_int(config, "max_position_embeddings", where)
        if config.get("max_position_embeddings") is not None else None,
        source=where, linear_layers=linear, delta=delta, attn_gate=hybrid,
        moe=moe.read(config, layers, where, _int) if sparse else None)


def read_shape(name_or_path: str, revision: str | None = None) -> Shape:
    path = find_config(name_or_path, revision)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{path}: cannot read as JSON: {exc}"]) from None
    if not isinstance(config, dict):
        raise ConfigError([f"{path}: expected a JSON object"])
    return shape_of(config, str(path), _processor_config(path.parent))


def _processor_config(directory: Path) -> dict[str, Any] | None:
    """The image processor's settings beside config.json (min/max pixels), if any, where
    transformers takes them from: processor_config.json's `image_processor` (how
    transformers 5 saves a processor, a run's final/ included), else
    preprocessor_config.json."""
    processor = _json_object(directory / "processor_config.json")
    nested = processor.get("image_processor") if processor else None
    return nested if isinstance(nested, dict) else \
        _json_object(directory / "preprocessor_config.json")


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def linears(shape: Shape, head: str, num_labels: int = 1) -> list[Linear]:
    """Every module LoRA can target, in named_modules() order. head: 'lm' or 'score'."""
    h, i = shape.hidden, shape.intermediate
    lm = shape.prefix
    out = [Linear(f"{lm}embed_tokens", shape.vocab + shape.extra_embeddings, h, False,
                  "embedding")]
    for n in range(shape.layers):
        a = f"{lm}layers.{n}.{_attention_name(shape, n)}"
        m = f"{lm}layers.{n}.mlp"
        if n in shape.linear_layers:
            out += [Linear(name, inp, o, False, "layer")
                    for name, inp, o in linear_attention.projections(shape, a)]
        else:  # Qwen3.5's gated attention: q_proj makes the query and its output's gate
            q_out = 2 * shape.q_dim if shape.attn_gate else shape.q_dim
            out += [Linear(f"{a}.q_proj", h, q_out, shape.qkv_bias, "layer"),
                    Linear(f"{a}.k_proj", h, shape.kv_dim, shape.qkv_bias, "layer"),
                    Linear(f"{a}.v_proj", h, shape.kv_dim, shape.qkv_bias, "layer"),
                    Linear(f"{a}.o_proj", shape.q_dim, h, shape.o_bias, "layer")]
        if moe.sparse(shape, n):  # fused 3-D experts and a router: no nn.Linear
            out += [Linear(name, inp, o, False, "layer")
                    for name, inp, o in moe.shared_linears(shape, m)]
            continue
        out += [Linear(f"{m}.gate_proj", h, i, shape.mlp_bias, "layer"),
                Linear(f"{m}.up_proj", h, i, shape.mlp_bias, "layer"),
                Linear(f"{m}.down_proj", i, h, shape.mlp_bias, "layer")]
    if head == "lm":
        out.append(Linear("lm_head", h, shape.vocab, False, "head"))
    else:
        out.append(Linear("score", h, num_labels, False, "head"))
    return out


def _attention_name(shape: Shape, n: int) -> str:
    """Layer n's token mixer: self_attn, mllama's cross_attn or Qwen3.5's linear_attn."""
    if n in shape.linear_layers:
        return "linear_attn"
    return cross_attention.attention_name(shape, n)


def matched(candidates: list[Linear], target) -> list[Linear]:
    """The candidates peft's target_modules matches: a string as a full regex, a list by
    name or suffix."""
    if isinstance(target, str):
        try:
            return [lin for lin in candidates if re.fullmatch(target, lin.name)]
        except re.error as exc:
            raise ConfigError([f"peft.target_modules: {target!r} is not a valid regex: "
                               f"{exc}"]) from None
    return [lin for lin in candidates
            if lin.name in target or any(lin.name.endswith(f".{key}") for key in target)]


def module_names(shape: Shape, head: str) -> list[str]:
    """Module names as named_modules() gives them (for modules_to_save matching)."""
    lm = shape.prefix
    names = [lm.rstrip("."), f"{lm}embed_tokens", f"{lm}layers"]
    for n in range(shape.layers):
        p = f"{lm}layers.{n}"
        a = f"{p}.{_attention_name(shape, n)}"
        if n in shape.linear_layers:
            names += [p, *linear_attention.module_names(shape, a)]
        else:
            names += [p, a, f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj", f"{a}.o_proj"]
        if (shape.qk_norm and n not in shape.linear_layers) or n in shape.cross_layers:
            names += [f"{a}.q_norm", f"{a}.k_norm"]
        names += moe.module_names(shape, f"{p}.mlp") if moe.sparse(shape, n) else [
            f"{p}.mlp", f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj",
            f"{p}.mlp.act_fn"]
        names += [f"{p}.{norm}" for norm in _norms(shape)]
    names += [f"{lm}norm", f"{lm}rotary_emb", "lm_head" if head == "lm" else "score"]
    return names


def _norms(shape: Shape) -> tuple[str, ...]:
    """A decoder layer's norms, as named_modules() lists them."""
    if shape.sandwich:
        return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
    return ("input_layernorm", "post_attention_layernorm")


def parameters(shape: Shape, head: str, num_labels: int = 1) -> list[Param]:
    """The model's parameters as model.parameters() yields them: a tied lm_head is the
    embedding matrix and appears once. A vision-language model's vision tower and projector
    come first, as transformers registers them."""
    h, lm = shape.hidden, shape.prefix
    params = shape.vision.parameters() if shape.vision else []
    params.append(Param(f"{lm}embed_tokens.weight", (shape.vocab + shape.extra_embeddings) * h,
                        "embedding", f"{lm}embed_tokens", h))
    for lin in linears(shape, head, num_labels):
        if lin.kind != "layer":
            continue
        if lin.name.endswith(".linear_attn.out_proj"):  # the first of a Gated DeltaNet's
            params += linear_attention.parameters(shape, lin.name.rsplit(".", 1)[0])
        if ".linear_attn." in lin.name:
            continue
        if lin.name.endswith(".mlp.shared_expert.gate_proj"):  # the router and experts first
            params += moe.parameters(shape, lin.name.rsplit(".", 2)[0])
        params.append(Param(f"{lin.name}.weight", lin.inp * lin.out, "linear", lin.name, lin.out))
        if lin.bias:
            params.append(Param(f"{lin.name}.bias", lin.out, "bias", lin.name))
        if shape.qk_norm and lin.name.endswith("o_proj"):
            base = lin.name.rsplit(".", 1)[0]
            params += [Param(f"{base}.q_norm.weight", shape.head_dim, "norm", f"{base}.q_norm"),
                       Param(f"{base}.k_norm.weight", shape.head_dim, "norm", f"{base}.k_norm")]
        layer = re.match(r"(.*\.layers\.\d+)\.", lin.name).group(1)
        if lin.name.endswith("o_proj"):  # a qwen3_moe sparse layer's MLP follows
            params += moe.after_attention(shape, layer)
        if lin.name == moe.last_linear(shape, layer):
            params += [Param(f"{layer}.{norm}.weight", h, "norm", f"{layer}.{norm}")
                       for norm in _norms(shape)]
            params += cross_attention.layer_extras(shape, layer)  # mllama's norms and gates
    params.append(Param(f"{lm}norm.weight", h, "norm", f"{lm}norm"))
    if head == "score":
        params.append(Param("score.weight", h * num_labels, "head", "score", num_labels))
    elif not shape.tied:
        params.append(Param("lm_head.weight", h * shape.vocab, "head", "lm_head", shape.vocab))
    return params
