"""estimate(experiment) -> Estimate: the numbers, the recommendation and what was assumed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetune.config.derived.kernels import Kernels, installed
from finetune.config.methods import method, names_where, spoken
from finetune.config.schema import Experiment
from finetune.errors import ConfigError
from finetune.estimate import linear_attention, vision, vision_peft
from finetune.estimate.census import census, value_census, value_head
from finetune.estimate.core import (CUDA_CONTEXT, FRAGMENTATION, GiB, Evaluation, evaluate,
                                    ladder_layouts)
from finetune.estimate.optimizers import model_of
from finetune.estimate.settings import Layout, Settings, settings_of
from finetune.estimate.shapes import Shape, read_shape
from finetune.estimate.vision.common import Training

DEFAULT_GPU_MEMORY = 80 * GiB
# A vision-language row's images, when the caller does not say: the common case of one
# picture per conversation (the estimate cannot see the data).
DEFAULT_IMAGES_PER_ROW = 1
# activation_checkpointing auto turns it off when the estimate without it stays under this
# share of the device: the estimate aims to be within 15 % of the measured peak.
CHECKPOINTING_MARGIN = 0.85


@dataclass
class Estimate:
    shape: Shape
    settings: Settings
    params: int                # parameters of the model, logical count (4-bit counts as 1)
    trainable_params: int
    configured: Evaluation     # the experiment's own layout, micro batch and checkpointing
    ladder: list[Evaluation]   # cheapest first, at the configured micro batch
    gpu_memory: int
    recommendation: list[str]
    assumptions: list[str] = field(default_factory=list)
    not_counted: list[str] = field(default_factory=list)
    checkpointing_note: str | None = None   # what activation_checkpointing auto decided
    parts: dict[str, int] = field(default_factory=dict)  # a VLM's parameters by part


def parts_of(tensors, shape: Shape) -> dict[str, int]:
    """A vision-language model's parameters by part (the LM head with the language model)."""
    found = {"language_model": 0, "vision_tower": 0, "projector": 0}
    for t in tensors:
        if t.role in ("lora", "magnitude", "copy", "value"):
            continue
        found[vision.part_of(t.name, shape.vision)] += t.numel
    return found


def overrides_for(layout: Layout) -> str:
    """The command-line overrides that select a layout."""
    if layout.strategy != "deepspeed":
        return f"distributed.strategy={layout.strategy}"
    text = f"distributed.strategy=deepspeed distributed.deepspeed.zero_stage={layout.zero_stage}"
    if layout.offload_optimizer != "none":
        text += f" distributed.deepspeed.offload_optimizer={layout.offload_optimizer}"
    if layout.offload_params != "none":
        text += f" distributed.deepspeed.offload_params={layout.offload_params}"
    return text


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _recommend(settings: Settings, ladder: list[Evaluation], retry) -> list[str]:
    gpus = f"{settings.world} x {_gib(ladder[0].gpu_memory)}"
    batch = settings.micro_batch
    first = next((ev for ev in ladder if ev.fits), None)
    if first is not None:
        return [f"cheapest setup that fits {gpus} at micro batch {batch}: "
                f"{first.layout.label()} ({_gib(first.total)} per GPU)",
                f"  largest micro batch that fits with it: {first.max_micro_batch}",
                f"  overrides: {overrides_for(first.layout)}"]
    smaller = next((ev for ev in ladder if ev.max_micro_batch >= 1), None)
    if smaller is not None:
        return [f"nothing fits {gpus} at micro batch {batch}; {smaller.layout.label()} fits "
                f"at micro batch {smaller.max_micro_batch} "
                f"({_gib(smaller.total_at(smaller.max_micro_batch))} per GPU)",
                f"  overrides: {overrides_for(smaller.layout)} "
                f"training.per_device_train_batch_size={smaller.max_micro_batch} (raise "
                "training.gradient_accumulation_steps to keep the global batch)"]
    if not settings.checkpointing:
        checkpointed = retry()
        found = next((ev for ev in checkpointed if ev.max_micro_batch >= 1), None)
        if found is not None:
            fit = min(batch, found.max_micro_batch)
            return [f"nothing fits {gpus} without activation checkpointing; with it, "
                    f"{found.layout.label()} fits at micro batch {fit}",
                    f"  overrides: training.activation_checkpointing=true "
                    f"{overrides_for(found.layout)} training.per_device_train_batch_size={fit}"]
    last = ladder[-1]
    return [f"nothing fits {gpus}: even {last.layout.label()} at micro batch 1 needs "
            f"{_gib(last.total_at(1))} per GPU; use more GPUs, (Q)LoRA, or shorter sequences"]


def _assumptions(settings: Settings, shape: Shape) -> list[str]:
    out = list(settings.notes)
    pair = " (chosen + rejected)" if settings.sequences == 2 else ""
    out.append(f"every sequence {settings.seq_len} tokens{pair}: the worst case, as batches "
               "are padded to their longest row")
    mask = {"none": " without a mask",
            "padding": " with a padding mask (k/v repeated per head)",
            "flattened": " with a dense mask over each flattened padding-free/packed row "
                         "(k/v repeated per head; grows with the square of the micro batch, "
                         "counted at the configured one)"}[settings.mask]
    attention = {"sdpa": "sdpa" + mask, "eager": "eager (scores kept)" + mask,
                 "flash": "a flash/varlen kernel, no mask"}
    out.append(f"attention: {attention[settings.attention]}")
    if shape.linear_layers:
        out.append(linear_attention.note(shape))
    if settings.fused_loss:
        out.append("use_liger_kernel: the fused linear cross-entropy never holds the logits "
                   "(counted as 0)")
    _, note = model_of(settings.optim)
    if note:
        out.append(note)
    out.append("weights, gradients and optimizer states: exact per tensor for one process; "
               "ZeRO/FSDP sharding: the ZeRO paper's arithmetic; activations: an estimate "
               "(docs/estimate.md)")
    if settings.device == "cuda":
        out.append(f"CUDA context, cuBLAS and NCCL workspaces: {_gib(CUDA_CONTEXT)} per GPU; "
                   f"allocator fragmentation: {FRAGMENTATION:.0%} of the tensors")
    else:
        out.append("distributed.device cpu: the numbers are per process, in host memory")
    if shape.tied:
        out.append("tied input/output embeddings: one matrix")
    if shape.vision:
        out += _vision_assumptions(settings, shape)
    return out


def _vision_assumptions(settings: Settings, shape: Shape) -> list[str]:
    v, n = shape.vision, settings.images_per_row
    tokens = n * v.image_tokens
    images = f"{n} image{'s' if n != 1 else ''} per row"
    training = settings.vision_training
    out = [f"{images} (assumed; the estimate does not read the data), {v.image_note()}, "
           f"{tokens} of the {settings.seq_len} tokens of each row: the sequence length "
           "counts them, as TRL's vision collator truncates after expanding the images",
           f"{v.tower_note()}; {_vision_training_note(settings)}"]
    if tokens > settings.seq_len:
        out.append(f"{images} is {tokens} image tokens, more than the {settings.seq_len} "
                   "tokens of a row: training refuses such rows (max_length cuts the image)")
    if shape.cross_layers:  # mllama: transformers decides per batch (MllamaTextModel)
        out.append("cross-attention layers: not counted, no row has a picture (transformers "
                   "skips them for a batch without one)" if not n else
                   "cross-attention layers: counted for every row, as in a batch with a "
                   "picture (the worst batch: transformers runs them for every row of it, a "
                   "row without one over padded pictures, and skips them only for a batch "
                   "without any)")
    return out


def _vision_training_note(settings: Settings) -> str:
    training, peft = settings.vision_training, settings.peft.type
    if peft == "none":
        frozen = [name for name, trains in (("vision tower", training.tower),
                                            ("projector", training.projector)) if not trains]
        return (f"frozen: {' and '.join(frozen)} (no gradients, optimizer states or "
                "activations of their own)" if frozen else
                "the whole model trains (no part is frozen under full fine-tuning)")
    where = "the language model's" + ("" if not training.tower else " and the vision tower's")
    kept = f"{settings.peft.bits}-bit" if peft == "qlora" else settings.precision
    text = (f"{peft}: adapters on {where} linear layers (vision section); the language "
            f"model's linear weights in {kept}"
            + (", the vision tower, projector and head unquantized (fp32 after "
               "prepare_model_for_kbit_training)" if peft == "qlora" else "")
            + ("; the projector trains whole (modules_to_save)" if training.projector
               else "; the projector frozen"))
    return text


def _not_counted(settings: Settings) -> list[str]:
    out = ["evaluation batches (per_device_eval_batch_size) and generation during evaluation",
           "host memory to load the model", "DeepSpeed communication buckets (about hidden^2 "
           "elements)"]
    own = settings.record
    if own.generates:
        out.insert(0, f"{settings.method}: generation (KV cache, sampling), rollout buffers and "
                      "any reward model (rewards.model)")
    if "distill" in own.sections:
        out.append("distill.teacher: the frozen teacher's weights and forward pass")
    if own.reference and own.reference.setting and settings.reference == "copy":
        out.append(f"{own.reference.setting}: assumed to have the policy's architecture")
    return out


def estimate(experiment: Experiment, gpus: int | None = None, gpu_memory: int | None = None,
             seq_len: int | None = None, device: str | None = None,
             precision: str | None = None, kernels: Kernels | None = None,
             images_per_row: int | None = None, image_size: tuple[int, int] | None = None,
             vision_training: Training | None = None) -> Estimate:
    """Per-GPU memory of training `experiment` on `gpus` GPUs of `gpu_memory` bytes each.
    device, precision, kernels: as resolved where the run happens (else assumed,
    settings_of). A vision-language model's images_per_row (default 1), image_size
    (width, height) in pixels before vision.max_pixels/min_pixels and the processor
    resize it (default: 640x480, where the tokens depend on it) and vision_training
    (which of its tower and projector train; default: as the experiment's vision section
    says)."""
    shape = read_shape(experiment.model.name_or_path, experiment.model.revision)
    kernels = kernels or installed()
    settings = settings_of(experiment, gpus, seq_len, shape.max_positions, device, precision,
                           kernels, shape.model_type)
    if shape.attn_softcap and settings.attention == "sdpa":
        # transformers runs Gemma 2's capped attention eagerly (it refuses sdpa)
        settings = settings.with_(attention="eager", notes=settings.notes + (
            "attention: Gemma 2 has no sdpa attention in transformers: eager counted",))
    if shape.vision:
        _check_vision(experiment, shape)
        shape = replace(shape, vision=shape.vision.for_image(
            vision_peft.picture_size(experiment, image_size)))
        settings = settings.with_(images_per_row=DEFAULT_IMAGES_PER_ROW
                                  if images_per_row is None else images_per_row,
                                  vision_training=vision_training
                                  or vision_peft.training_of(experiment, shape))
    memory = gpu_memory or DEFAULT_GPU_MEMORY
    tensors = census(shape, settings)
    value = []
    if settings.value_model == "separate":
        value = value_census(shape, settings)
    elif settings.value_model == "shared":
        tensors = tensors + value_head(shape)

    def run(layouts, checkpointing):
        return [evaluate(shape, settings, tensors, value, layout, settings.micro_batch,
                         checkpointing, memory) for layout in layouts]

    checkpointing_note = None
    if settings.checkpointing is None:  # auto: off where the run fits without it
        plain = run([settings.layout], False)[0]
        on = plain.total > CHECKPOINTING_MARGIN * memory
        unit = "GPU" if settings.device == "cuda" else "process"
        checkpointing_note = (
            f"activation checkpointing {'on' if on else 'off'} (auto): without it the "
            f"estimate is {_gib(plain.total)} per {unit}, {'over' if on else 'within'} "
            f"{CHECKPOINTING_MARGIN:.0%} of {_gib(memory)}")
        settings = settings.with_(checkpointing=on)
    configured = run([settings.layout], settings.checkpointing)[0]
    ladder = run(ladder_layouts(settings), settings.checkpointing)
    recommendation = _recommend(settings, ladder, lambda: run(ladder_layouts(settings), True))
    if settings.checkpointing and checkpointing_note is None:  # off wherever not needed
        plain = evaluate(shape, settings, tensors, value, settings.layout, settings.micro_batch,
                         False, memory)
        if plain.fits:
            recommendation.append(
                f"  without activation checkpointing it still fits ({_gib(plain.total)} per "
                "GPU): training.activation_checkpointing=false saves its recomputation, "
                "about a quarter of the step's compute")
    logits = next(size for key, _, size in configured.rows if key == "logits")
    liger_could = kernels.liger is None or kernels.liger_patches(shape.model_type)
    if logits > 0.25 * configured.total and settings.record.fused_loss and liger_could:
        recommendation.append(f"  the logits and loss take {_gib(logits)} per GPU: "
                              "training.use_liger_kernel=true computes the loss without them")
    if checkpointing_note:
        recommendation.append(f"  {checkpointing_note}")
    return Estimate(
        shape=shape, settings=settings,
        params=sum(t.numel for t in tensors
                   if t.role not in ("lora", "magnitude", "copy", "value")),
        trainable_params=sum(t.numel for t in tensors + value if t.trainable),
        configured=configured, ladder=ladder, gpu_memory=memory, recommendation=recommendation,
        assumptions=_assumptions(settings, shape), not_counted=_not_counted(settings),
        checkpointing_note=checkpointing_note,
        parts=parts_of(tensors, shape) if shape.vision else {})


def _check_vision(experiment: Experiment, shape: Shape) -> None:
    """What a vision-language model trains with so far (config/rules/vision.py refuses
    the rest at validate for a local model; a cached hub model's config is read here)."""
    what = f"{shape.source}: a {shape.model_type} vision-language model"
    problems = []
    if not method(experiment.method).vision:
        problems.append(f"{what} trains only with "
                        f"{spoken(names_where(lambda m: m.vision))} yet (docs/vision.md)")
    if problems:
        raise ConfigError(problems)
