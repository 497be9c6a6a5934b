"""The estimate: model states + activations + overheads, for the experiment's own layout
and for the ladder of layouts a recommendation picks from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.estimate import activations as act
from finetune.estimate import cross_attention
from finetune.estimate.census import Tensor, lora_targets
from finetune.estimate.vision_peft import tower_weights
from finetune.estimate.memory import States, model_states
from finetune.estimate.settings import Layout, Settings
from finetune.estimate.shapes import Shape

GiB = 1024 ** 3
CUDA_CONTEXT = 1 * GiB   # CUDA context, cuBLAS and NCCL workspaces: a stated constant
FRAGMENTATION = 0.05     # allocator slack, as a fraction of the tensors


@dataclass
class Evaluation:
    layout: Layout
    rows: list[tuple[str, str, int]]   # (key, label, bytes per GPU)
    states: States
    fixed: int                         # everything but activations, before fragmentation
    per_sample: int                    # activations + logits of one sample
    micro_batch: int
    checkpointing: bool
    gpu_memory: int
    overhead: int                      # CUDA context (0 for a CPU run)

    def total_at(self, batch: int) -> int:
        tensors = self.fixed + batch * self.per_sample
        return int(tensors * (1 + FRAGMENTATION)) + self.overhead

    @property
    def total(self) -> int:
        return self.total_at(self.micro_batch)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory

    @property
    def max_micro_batch(self) -> int:
        room = (self.gpu_memory - self.overhead) / (1 + FRAGMENTATION) - self.fixed
        if self.per_sample <= 0 or room < self.per_sample:
            return 0
        # The largest batch whose total fits, by bisection: total_at rounds, and room's
        # float can be far from an integer at huge sizes.
        low, high = 0, int(room // self.per_sample) + 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.total_at(mid) <= self.gpu_memory:
                low = mid
            else:
                high = mid - 1
        return low


def regime(settings: Settings, layout: Layout) -> act.Regime:
    """Dtypes of the forward pass under a layout (see activations.py)."""
    spec = settings.peft
    half = settings.precision != "fp32"
    c = 2 if half else 4
    sharded16 = half and layout.strategy in ("deepspeed", "fsdp")  # module cast to 16 bits
    lora = spec.type != "none"
    quantized = spec.type == "qlora"
    if sharded16:
        residual, autocast, adapter = 2, False, 2
    elif spec.type == "none":
        residual, autocast, adapter = 4, half, 0
    elif quantized:
        residual, autocast, adapter = 4, half, 2 if settings.trl_cast else 4
    else:
        residual, autocast, adapter = c, half, 4
    return act.Regime(
        residual=residual, compute=c, autocast=autocast, base_trainable=not lora,
        quantized=spec.bits if quantized else 0, adapter=adapter if lora else 0,
        rank=spec.r if lora else 0,
        dropout=lora and spec.dropout > 0, dora=lora and spec.use_dora,
        cuda=settings.device == "cuda",
        attention=settings.attention, mask_keys=mask_keys(settings),
        liger=settings.fused_loss)


def mask_keys(settings: Settings) -> int:
    """Key positions per query token in the attention mask (0: no mask). The flattened
    row's mask grows with the micro batch: counted at the configured one."""
    rows = settings.micro_batch * settings.sequences
    return {"none": 0, "padding": settings.seq_len,
            "flattened": rows * settings.seq_len}[settings.mask]


def layer_targets(shape: Shape, settings: Settings) -> list[frozenset[str]]:
    if settings.peft.type == "none":
        return [frozenset()] * shape.layers
    found = [lin.name for lin in lora_targets(shape, settings)]
    out = []
    for n in range(shape.layers):
        prefix = f"{shape.prefix}layers.{n}."
        out.append(frozenset(name.rsplit(".", 1)[1] for name in found if name.startswith(prefix)))
    return out


def activation_bytes(shape: Shape, settings: Settings, layout: Layout,
                     checkpointing: bool) -> act.Activations:
    reg = regime(settings, layout)
    full = settings.peft.type == "none"
    saved_head = settings.head == "score" or "lm_head" in (settings.peft.modules_to_save or [])
    images = settings.vision_training
    targets = layer_targets(shape, settings)
    policy = act.activations(
        shape, reg, targets, settings.seq_len, settings.logit_tokens,
        settings.sequences, checkpointing, head_trainable=full or saved_head,
        lm_head=settings.head == "lm",
        # image features from a trained tower or projector need the gradient of the
        # language model's input (mllama's reach it through cross-attention instead)
        input_grad=bool(shape.vision and settings.images_per_row and not shape.cross_layers)
        and (images.tower or images.projector),
        # mllama: transformers skips the cross-attention layers for a batch without
        # pictures (and runs them for every row of one with a picture)
        skipped=frozenset(shape.cross_layers) if shape.vision and not settings.images_per_row
        else frozenset())
    if settings.fused_loss:  # Liger's fused linear cross-entropy works chunk by chunk
        policy = replace(policy, logits_saved=0, logits_peak=0)
    if shape.vision and settings.images_per_row:
        # The tower and projector are never quantized (llm_int8_skip_modules).
        unquantized = replace(reg, quantized=0, dora=False,
                              tower=tower_weights(images, not full))
        policy = replace(policy, vision=settings.sequences * settings.images_per_row
                         * shape.vision.image_bytes(unquantized, checkpointing, images))
        if shape.cross_layers:  # the language model's cross-attention over each image
            policy = replace(policy, layers=policy.layers + settings.sequences
                             * settings.images_per_row * cross_attention.image_bytes(
                                 shape, reg, targets, settings.seq_len, checkpointing,
                                 images.tower or images.projector))
    if settings.value_model != "separate":
        return policy
    # ppo: the separate value backbone runs its own forward, fully trained in fp32 + autocast.
    value_reg = act.Regime(residual=4, compute=reg.compute, autocast=reg.compute == 2,
                           base_trainable=True, quantized=0, attention=reg.attention,
                           mask_keys=reg.mask_keys, cuda=reg.cuda)
    value = act.activations(shape, value_reg, [frozenset()] * shape.layers, settings.seq_len, 0,
                            1, checkpointing, head_trainable=True, lm_head=False)
    return act.Activations(policy.layers + value.layers, policy.other + value.other,
                           policy.logits_saved, policy.logits_peak)


def evaluate(shape: Shape, settings: Settings, tensors: list[Tensor], value: list[Tensor],
             layout: Layout, micro_batch: int, checkpointing: bool, gpu_memory: int) -> Evaluation:
    states = model_states(tensors, value, settings, layout)
    acts = activation_bytes(shape, settings, layout, checkpointing)
    ckpt = "checkpointed" if checkpointing else "no checkpointing"
    rows = [
        ("weights", "frozen weights", states.weights),
        ("trainable", "trainable parameters", states.trainable),
        ("gradients", "gradients", states.gradients),
        ("optimizer", f"optimizer states ({settings.optim})", states.optimizer),
        ("master", "fp32 master weights", states.master),
        ("buffers", states.buffers_label or "communication buffers", states.buffers),
        ("autocast", "autocast 16-bit weight copies", states.autocast),
        ("dora", "DoRA base weight copies", states.dora),
        ("reference", "reference model", states.reference),
        ("value", "value model (weights, gradients, optimizer)", states.value),
        ("activations", f"activations ({shape.layers} layers, {ckpt})",
         micro_batch * (acts.layers + acts.other)),
        ("vision", f"vision tower and projector activations ({_images(settings)})",
         micro_batch * acts.vision),
        ("logits", "logits and loss", micro_batch * (acts.logits_saved + acts.logits_peak)),
    ]
    fixed = sum(b for key, _, b in rows if key not in ("activations", "vision", "logits"))
    overhead = CUDA_CONTEXT if settings.device == "cuda" else 0
    return Evaluation(layout, rows, states, fixed, acts.total, micro_batch, checkpointing,
                      gpu_memory, overhead)


def _images(settings: Settings) -> str:
    n = settings.images_per_row
    return f"{n} image{'s' if n != 1 else ''} per row"


def ladder_layouts(settings: Settings) -> list[Layout]:
    """Cheapest first: plain data parallel, ZeRO-1, -2, -3, then offload. Only layouts
    finetune accepts for the experiment (config/rules/: the method's strategies, qlora not with
    ZeRO-3; tensor parallelism: ZeRO 0-2, sequence parallelism: ZeRO 1-2, with the same
    group size)."""
    base = Layout("ddp" if settings.world > 1 else "none")
    tp = settings.layout.tensor_parallel
    if tp > 1:  # AutoTP runs under ZeRO 0-2 only (config/rules/parallel.py)
        return [Layout("deepspeed", stage, tensor_parallel=tp) for stage in (0, 1, 2)]
    sp = settings.layout.sequence_parallel
    if sp > 1:  # Ulysses: ZeRO 1-2 (config/rules/sequence.py)
        return [Layout("deepspeed", stage, sequence_parallel=sp) for stage in (1, 2)]
    if "deepspeed" not in settings.record.strategies:
        return [base]
    if settings.peft.type == "qlora":
        return [base, Layout("deepspeed", 1), Layout("deepspeed", 2),
                Layout("deepspeed", 2, offload_optimizer="cpu")]
    return [base, Layout("deepspeed", 1), Layout("deepspeed", 2), Layout("deepspeed", 3),
            Layout("deepspeed", 3, offload_optimizer="cpu"),
            Layout("deepspeed", 3, offload_optimizer="cpu", offload_params="cpu")]
