"""Model states per GPU for one layout: the arithmetic over the census.

none/ddp follow finetune's own loading (census.py): gradients in the parameter's dtype;
autocast keeps a 16-bit copy of every fp32 trainable weight a matmul reads from the
forward to its backward; DDP (gradient_as_bucket_view off, as the Trainer leaves it) keeps
its gradient buckets, a second copy of the gradients.

deepspeed follows the ZeRO paper (Rajbhandari et al. 2020): with bf16/fp16 the engine
casts the module to 16 bits (2 bytes per floating parameter; quantized weights stay) and
keeps fp32 master weights and optimizer states for the trainable ones. Stage 1 shards
master weights and optimizer states over the processes, stage 2 also the gradients,
stage 3 also the parameters (then a layer's worth is gathered at a time). Optimizer
offload moves master weights, optimizer states and an fp32 gradient partition to the
host; parameter offload (stage 3) the 16-bit parameters. Tensor parallelism (AutoTP)
splits every decoder linear (and its bias) over its group, so each process holds 1/tp of
them, and ZeRO shards over the data parallel groups (processes / tp); embeddings, norms and
the output head stay whole (vocab_parallel_lm_head is off).

fsdp (approximate): FULL_SHARD and HYBRID_SHARD shard like ZeRO-3 (HYBRID within a
machine), SHARD_GRAD_OP keeps every unsharded 16-bit parameter from the forward to the
backward, NO_SHARD is data parallel; cpu_offload moves the sharded states to the host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from finetune.config.derived.effective import model_precision
from finetune.estimate import vision
from finetune.estimate.census import BYTES, Tensor
from finetune.estimate.optimizers import state_bytes
from finetune.estimate.settings import Layout, Settings

FLOAT = ("fp32", "bf16", "fp16")
# What AutoTP splits: the decoder's linear layers (the model's tp_plan) and their biases.
TENSOR_PARALLEL_ROLES = ("linear", "bias")
# A decoder layer (or a vision tower's block): what ZeRO-3 and FSDP gather at once.
LAYER = re.compile(r"(.*\.(?:layers|blocks)\.\d+)\.")
# A VLM's tp_plan is its language model's: the vision tower and projector stay whole.
WHOLE_UNDER_TENSOR_PARALLEL = vision.VISION_PREFIXES


@dataclass
class States:
    weights: int = 0       # frozen parameters (quantization constants included)
    trainable: int = 0     # trainable parameters as the model holds them
    gradients: int = 0
    optimizer: int = 0
    master: int = 0        # fp32 master weights (DeepSpeed with bf16/fp16)
    buffers: int = 0       # DDP buckets / ZeRO-3 or FSDP gathered parameters
    buffers_label: str = ""
    autocast: int = 0      # 16-bit copies of fp32 weights that matmuls read (autocast)
    dora: int = 0          # DoRA: copies of the base weights its extra matmul saves
    reference: int = 0     # frozen reference model (dpo, grpo with beta, ppo)
    value: int = 0         # ppo's separate value model: weights, gradients, optimizer
    cpu: int = 0           # host memory per process (offload)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _elt(t: Tensor) -> int:
    return t.nbytes // t.numel


def optimizer_bytes(optim: str, tensors: list[Tensor], elt: int | None = None) -> int:
    return sum(state_bytes(optim, t.numel, elt or _elt(t), t.shape2d)
               for t in tensors if t.trainable)


def _with_gradient(tensors: list[Tensor]) -> list[Tensor]:
    """The trainable tensors that get a .grad (torch's optimizers skip the others)."""
    return [t for t in tensors if t.trainable and t.gradient]


def autocast_bytes(tensors: list[Tensor], settings: Settings) -> int:
    """16-bit copies autocast makes of fp32 weights that matmuls read: cached for the whole
    forward when they train, saved for the backward when frozen (QLoRA's lm_head)."""
    if settings.precision == "fp32":
        return 0
    return sum(2 * t.numel for t in tensors if t.matmul and t.dtype == "fp32")


def dora_bytes(tensors: list[Tensor], settings: Settings, layout: Layout) -> int:
    """DoRA with dropout runs the base layer again on the dropped-out input, with the base
    weight cast to the input's dtype (the adapter's): a new tensor, saved for the backward,
    when that differs from the weight's own dtype, or when the weight is dequantized
    (QLoRA). Counted for every DoRA layer (the first saves none when its input needs no
    gradient)."""
    spec = settings.peft
    if not spec.use_dora or spec.dropout == 0:
        return 0
    half = settings.precision != "fp32"
    if half and layout.strategy in ("deepspeed", "fsdp"):
        return 0  # the module, adapters included, is cast to 16 bits: no copy
    if spec.type == "lora" and not half:
        return 0
    elt = 2 if half else 4
    shapes = {t.name: t.shape2d for t in tensors if t.role == "lora" and t.shape2d}
    return sum(elt * shapes[name][1] * shapes[name[:-1] + "B"][0]  # in (of A) x out (of B)
               for name in shapes if name.endswith(".lora_A"))


def gathered_numel(tensors: list[Tensor]) -> int:
    """Parameters gathered at once under ZeRO-3/FSDP: the current and the prefetched layer,
    sized as the largest (a hybrid model's Gated DeltaNet and attention layers differ, as
    do mllama's cross-attention ones), or the embedding matrix when that is bigger."""
    layers: dict[str, int] = {}
    for t in tensors:
        found = LAYER.match(t.name)
        if found:
            layers[found.group(1)] = layers.get(found.group(1), 0) + t.numel
    embedding = max((t.numel for t in tensors if t.role == "embedding"), default=0)
    return max(2 * max(layers.values(), default=0), embedding)


def reference_numel(tensors: list[Tensor]) -> int:
    return sum(t.numel for t in tensors if t.role not in ("lora", "magnitude", "copy"))


def _plain(tensors: list[Tensor], value: list[Tensor], settings: Settings,
           layout: Layout) -> States:
    s = States()
    s.weights = sum(t.nbytes for t in tensors if not t.trainable)
    s.trainable = sum(t.nbytes for t in tensors if t.trainable)
    s.gradients = sum(t.nbytes for t in _with_gradient(tensors))
    s.optimizer = optimizer_bytes(settings.optim, _with_gradient(tensors))
    if layout.strategy == "ddp" and settings.world > 1:  # buckets for all that requires grad
        s.buffers, s.buffers_label = s.trainable, "DDP gradient buckets"
    s.autocast = autocast_bytes(tensors + value, settings)
    s.dora = dora_bytes(tensors, settings, layout)
    if value:
        own = sum(t.nbytes for t in value)
        ddp = own if s.buffers else 0
        s.value = 2 * own + ddp + optimizer_bytes(settings.optim, value)
    return s


def tensor_parallel_share(tensors: list[Tensor], tp: int) -> list[Tensor]:
    """The part of each tensor one process of a tensor-parallel group holds."""
    if tp == 1:
        return tensors
    return [replace(t, numel=_ceil(t.numel, tp), nbytes=_ceil(t.nbytes, tp))
            if t.role in TENSOR_PARALLEL_ROLES
            and not t.name.startswith(WHOLE_UNDER_TENSOR_PARALLEL) else t for t in tensors]


def _deepspeed(tensors: list[Tensor], settings: Settings, layout: Layout) -> States:
    s = States()
    half = settings.precision != "fp32"
    n, stage = settings.world // layout.tensor_parallel, layout.zero_stage
    tensors = tensor_parallel_share(tensors, layout.tensor_parallel)

    def held(t: Tensor) -> int:  # the engine casts floating parameters to 16 bits
        return 2 * t.numel if half and t.dtype in FLOAT else t.nbytes

    trainable = [t for t in tensors if t.trainable]
    numel = sum(t.numel for t in trainable)
    frozen = sum(held(t) for t in tensors if not t.trainable)
    params = sum(held(t) for t in trainable)
    s.weights = _ceil(frozen, n) if stage == 3 else frozen
    s.trainable = _ceil(params, n) if stage == 3 else params
    grads = 2 * numel if half else params
    s.gradients = _ceil(grads, n) if stage >= 2 else grads
    master = 4 * numel if half else 0
    opt = optimizer_bytes(settings.optim, trainable, 4)
    s.master = _ceil(master, n) if stage >= 1 else master
    s.optimizer = _ceil(opt, n) if stage >= 1 else opt
    if stage == 3:
        s.buffers, s.buffers_label = 2 * gathered_numel(tensors), "ZeRO-3 gathered parameters"
    if layout.offload_optimizer != "none" and stage >= 1:
        host = s.master + s.optimizer + _ceil(4 * numel, n)  # + the fp32 gradient partition
        s.cpu += host if layout.offload_optimizer == "cpu" else 0
        s.master = s.optimizer = 0
    if layout.offload_params != "none" and stage == 3:
        s.cpu += (s.weights + s.trainable) if layout.offload_params == "cpu" else 0
        s.weights = s.trainable = 0
    return s


def _fsdp(tensors: list[Tensor], settings: Settings, layout: Layout) -> States:
    s = _plain(tensors, [], settings, Layout("none"))
    s.autocast = 0  # FSDP's mixed precision casts at the all-gather instead
    shards = {"FULL_SHARD": settings.world, "SHARD_GRAD_OP": settings.world,
              "HYBRID_SHARD": settings.per_machine}.get(layout.fsdp_sharding, 1)
    for name in ("weights", "trainable", "gradients", "optimizer"):
        setattr(s, name, _ceil(getattr(s, name), shards))
    if layout.fsdp_sharding == "SHARD_GRAD_OP":
        s.buffers = 2 * sum(t.numel for t in tensors if t.dtype in FLOAT)
        s.buffers_label = "FSDP unsharded parameters (forward to backward)"
    elif shards > 1:
        s.buffers, s.buffers_label = 2 * gathered_numel(tensors), "FSDP gathered parameters"
    s.dora = dora_bytes(tensors, settings, layout)
    if layout.fsdp_offload:
        s.cpu = s.weights + s.trainable + s.gradients + s.optimizer
        s.weights = s.trainable = s.gradients = s.optimizer = 0
    return s


def model_states(tensors: list[Tensor], value: list[Tensor], settings: Settings,
                 layout: Layout) -> States:
    if layout.strategy == "deepspeed":
        s = _deepspeed(tensors, settings, layout)
    elif layout.strategy == "fsdp":
        s = _fsdp(tensors, settings, layout)
    else:
        s = _plain(tensors, value, settings, layout)
    if settings.reference == "copy":
        numel = reference_numel(tensors)
        if layout.strategy == "deepspeed":
            ref = 2 * numel if settings.precision != "fp32" else 4 * numel
            s.reference = _ceil(ref, settings.world) if layout.zero_stage == 3 else ref
        else:
            precision = model_precision("reference", settings.peft.type, settings.precision)
            ref = BYTES[precision] * numel
            s.reference = _ceil(ref, settings.world) if layout.strategy == "fsdp" else ref
    return s
