"""Every tensor the model holds, with its dtype and whether it trains: the exact part.

Mirrors what finetune.model.load/peft (and TRL) do to the weights:
- full fine-tuning loads fp32 master weights (autocast does the mixed precision);
- (Q)LoRA loads the frozen base in the compute dtype (bf16/fp16; fp32 in fp32 runs);
- QLoRA quantizes every nn.Linear inside the decoder layers with bitsandbytes; the
  embeddings, norms, biases, the output head and a MoE's fused experts and router
  (nn.Parameters, moe.py) stay unquantized and
  prepare_model_for_kbit_training casts those (16-bit) to fp32;
- peft creates LoRA A/B (and DoRA magnitudes) in fp32 (autocast_adapter_dtype); a
  module in modules_to_save (and the score head of reward/classify, which peft adds)
  gets a trainable copy in the dtype of the original;
- TRL's trainers (sft, dpo, reward, grpo) cast every trainable parameter of a quantized
  model except DoRA magnitudes to bf16; finetune casts them back in fp32 runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from finetune.config.derived.effective import model_precision
from finetune.errors import ConfigError
from finetune.estimate import moe, vision, vision_peft
from finetune.estimate.settings import Settings
from finetune.estimate.param import Param
from finetune.estimate.shapes import (Linear, Shape, linears, matched, module_names,
                                      parameters)

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64          # bitsandbytes 4-bit blocksize
NESTED_BLOCK = 256      # double quantization: blocks of absmax values
NESTED_CODE = 256 * 4   # fp32 code book of the nested (8-bit dynamic) quantization
NF4_CODE = 16 * 4       # fp32 code book of the 4-bit data type, one per weight


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    nbytes: int           # as held, quantization constants included
    trainable: bool
    dtype: str            # fp32, bf16, fp16, nf4, int8
    role: str             # embedding, norm, linear, bias, head, lora, magnitude, copy, value
    matmul: bool = False  # a weight a matmul consumes (autocast makes a 16-bit copy of it)
    shape2d: tuple[int, int] | None = None
    # False: trainable, but the loss never reaches it (a VLM's unused vision modules): no
    # .grad, so no gradient and no torch optimizer state
    gradient: bool = True


def quantized_bytes(numel: int, out: int, bits: int, double_quant: bool) -> int:
    """Bytes of one bitsandbytes-quantized Linear weight, constants included."""
    if bits == 8:
        return numel + 4 * out  # int8 weight + one fp32 scale (SCB) per output row
    packed = -(-numel // 2)
    blocks = -(-numel // NF4_BLOCK)
    if not double_quant:
        return packed + 4 * blocks + NF4_CODE
    nested = -(-blocks // NESTED_BLOCK)
    return packed + blocks + 4 * nested + NESTED_CODE + 4 + NF4_CODE  # + fp32 offset


def compute_dtype(settings: Settings) -> str:
    return settings.precision  # bf16, fp16 or fp32


def lora_targets(shape: Shape, settings: Settings) -> list[Linear]:
    """The modules peft wraps with LoRA, matched the way peft matches them (a
    vision-language model's as finetune.model.vision_parts chooses them)."""
    spec = settings.peft
    saved = _modules_to_save(settings, shape)
    candidates = linears(shape, settings.head, settings.num_labels)
    target = spec.target_modules
    moe.refuse_lora_on_experts(shape, target)
    target = moe.peft_target(shape, target, module_names(shape, settings.head))
    if shape.vision:
        found = vision_peft.lora_targets(shape, settings.vision_training, target, candidates,
                                         vision_peft.projector_modules(shape))
    elif isinstance(target, str) and target.lower() == "all-linear":
        # peft: every nn.Linear except the output layer (lm_head, or the score head).
        found = [lin for lin in candidates if lin.kind == "layer"]
    else:
        found = matched(candidates, target)
    found = [lin for lin in found
             if not any(re.match(rf"(^|.*\.){m}($|\..*)", lin.name) for m in saved)]
    if not found:
        raise ConfigError([f"peft.target_modules: {target!r} matches no Linear or embedding "
                           f"of this {shape.model_type} model"])
    return found


def _modules_to_save(settings: Settings, shape: Shape | None = None) -> list[str]:
    names = list(settings.peft.modules_to_save or [])
    if settings.head == "score":
        names += ["classifier", "score"]  # peft's sequence-classification default
    if shape is not None and shape.vision and settings.vision_training.projector:
        # vision.train_projector under LoRA: the projector trains whole (vision_parts)
        names += [m for m in vision_peft.projector_modules(shape) if m not in names]
    return names


def _adapters(lin: Linear, r: int, dora: bool) -> list[Tensor]:
    if lin.kind == "embedding":  # lora_embedding_A (r x vocab), lora_embedding_B (hidden x r)
        shapes = [(f"{lin.name}.lora_embedding_A", r, lin.inp),
                  (f"{lin.name}.lora_embedding_B", lin.out, r)]
    else:
        shapes = [(f"{lin.name}.lora_A", r, lin.inp), (f"{lin.name}.lora_B", lin.out, r)]
    # F.embedding reads lora_embedding_A without a matmul, so autocast makes no copy of it.
    out = [Tensor(name, a * b, a * b * 4, True, "fp32", "lora",
                  not name.endswith("lora_embedding_A"), (a, b))
           for name, a, b in shapes]
    if dora:
        out.append(Tensor(f"{lin.name}.lora_magnitude_vector", lin.out, lin.out * 4, True,
                          "fp32", "magnitude"))
    return out


def _matmul(param: Param) -> bool:
    # conv: a vision patch embedding; router: a MoE's gate, read with F.linear (its experts
    # run grouped_mm, which autocast leaves alone: moe.py)
    return param.role in ("linear", "head", "bias", "conv", "router")


def _2d(param: Param) -> tuple[int, int] | None:
    return (param.out, param.numel // param.out) if param.out else None


def _reads_output(p: Param, shape: Shape, settings: Settings) -> bool:
    """Is p the LM head's matrix, read by a matmul in the forward? (A frozen fp32 one, as
    under QLoRA, is then saved as a 16-bit copy for the backward.) A copy in
    modules_to_save replaces it."""
    if settings.head != "lm" or "lm_head" in _modules_to_save(settings, shape):
        return False
    return p.role == "head" or (shape.tied and p.role == "embedding")


def _full(params: list[Param], shape: Shape, settings: Settings) -> list[Tensor]:
    tied_lm = settings.head == "lm" and shape.tied
    unused = shape.vision.unreached() if shape.vision else ()
    return [Tensor(p.name, p.numel, p.numel * 4, True, "fp32", p.role,
                   _matmul(p) or (tied_lm and p.role == "embedding"), _2d(p),
                   gradient=not p.name.startswith(unused))
            for p in params]


def _freeze_vision(tensors: list[Tensor], shape: Shape, settings: Settings) -> list[Tensor]:
    """A frozen vision tower or projector (settings.vision_training) keeps its weights
    without gradients or optimizer states. A matmul saves a 16-bit copy of a frozen
    fp32 weight only where a trained part before it needs the input gradient: the
    projector's, under a trained tower."""
    training = settings.vision_training
    if not shape.vision or (training.tower and training.projector):
        return tensors
    out = []
    for t in tensors:
        part = vision.part_of(t.name, shape.vision)
        if vision_peft.frozen_by_name(t.name, shape, training):
            t = replace(t, trainable=False, gradient=False,
                        matmul=t.matmul and part == "projector" and training.tower)
        out.append(t)
    return out


def census(shape: Shape, settings: Settings) -> list[Tensor]:
    """The policy model's tensors after loading, peft and the trainer's casts."""
    params = parameters(shape, settings.head, settings.num_labels)
    spec = settings.peft
    if spec.type == "none":
        return _freeze_vision(_full(params, shape, settings), shape, settings)
    c = compute_dtype(settings)
    quantized = spec.type == "qlora"
    unused = shape.vision.unreached() if shape.vision else ()
    targets = lora_targets(shape, settings)
    target_names = {lin.name for lin in targets}
    copied = _copied(shape, settings)
    out: list[Tensor] = []
    for p in params:
        if quantized and p.role == "linear" and vision_peft.quantized(p.module, shape):
            dtype = "nf4" if spec.bits == 4 else "int8"
            nbytes = quantized_bytes(p.numel, p.out, spec.bits, spec.double_quant)
            out.append(Tensor(p.name, p.numel, nbytes, False, dtype, p.role))
            continue
        dtype = "fp32" if quantized else c  # prepare_model_for_kbit_training upcasts the rest
        # peft's bias "all": every parameter named bias (a vision tower's LayerNorms' too)
        # but a copied module's original
        trains = (spec.bias == "all" and "bias" in p.name
                  and not any(p.name.startswith(m + ".") for m in copied)) or (
            p.role == "bias" and spec.bias == "lora_only" and p.module in target_names)
        out.append(Tensor(p.name, p.numel, p.numel * BYTES[dtype], trains, dtype, p.role,
                          (trains and _matmul(p)) or _reads_output(p, shape, settings)
                          or p.role == "router",  # frozen fp32 (QLoRA): a 16-bit copy saved
                          gradient=not p.name.startswith(unused)))
    for lin in targets:
        out += [replace(t, gradient=not lin.name.startswith(unused))
                for t in _adapters(lin, spec.r, spec.use_dora)]
    out += _copies(params, shape, settings, quantized)
    if quantized and settings.trl_cast:
        out = [_to_bf16(t) if t.trainable and t.role != "magnitude" else t for t in out]
    return out


def _copied(shape: Shape, settings: Settings) -> list[str]:
    """The modules modules_to_save copies (peft matches module names by suffix)."""
    keys = _modules_to_save(settings, shape)
    if not keys:
        return []
    names = module_names(shape, settings.head) + (
        vision_peft.module_names(shape) if shape.vision else [])
    found = [name for name in names if any(name.endswith(key) for key in keys)]
    # A module inside another matched one is part of that copy already.
    return [m for m in found if not any(m.startswith(o + ".") for o in found)]


def _copies(params: list[Param], shape: Shape, settings: Settings, quantized: bool) -> list[Tensor]:
    """Trainable copies made by modules_to_save (peft matches module names by suffix)."""
    found = _copied(shape, settings)
    dtype = "fp32" if quantized else compute_dtype(settings)
    out = []
    for module in found:
        owned = [p for p in params if p.module == module or p.module.startswith(module + ".")]
        if module == "lm_head" and shape.tied:  # the copy unties the shared matrix
            owned = [Param("lm_head.weight", shape.vocab * shape.hidden, "head", "lm_head")]
        for p in owned:
            if quantized and p.role == "linear" and vision_peft.quantized(p.module, shape):
                raise ConfigError([f"peft.modules_to_save: {module} holds 4/8-bit quantized "
                                   "weights; the estimator does not model training copies of them"])
            out.append(Tensor(f"{p.name} (copy)", p.numel, p.numel * BYTES[dtype], True, dtype,
                              "copy", _matmul(p)))
    return out


def _to_bf16(t: Tensor) -> Tensor:
    return Tensor(t.name, t.numel, t.numel * 2, t.trainable, "bf16", t.role, t.matmul, t.shape2d)


def value_census(shape: Shape, settings: Settings) -> list[Tensor]:
    """PPO's separate value model: the policy's backbone (no head) in the value model's
    precision (fp32), all trainable, plus a linear value head with a bias
    (finetune.trainers.ppo_model)."""
    params = [p for p in parameters(shape, "score", 1) if p.role != "head"]
    dtype = model_precision("value", settings.peft.type, settings.precision)
    out = [Tensor(f"value.{p.name}", p.numel, p.numel * BYTES[dtype], True, dtype, "value",
                  _matmul(p)) for p in params]
    return out + value_head(shape)


def value_head(shape: Shape) -> list[Tensor]:
    h = shape.hidden
    return [Tensor("value_head.weight", h, 4 * h, True, "fp32", "value", True, (1, h)),
            Tensor("value_head.bias", 1, 4, True, "fp32", "value", True)]
