"""The experiment schema: one pydantic model per YAML section, unknown keys rejected.

Descriptions live in Field(description=...) so the experiment reference (`finetune
reference`, config/reference.py; docs/experiment.md is its output) comes from this file
instead of being written twice. Imports no torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from finetune.config import methods
from finetune.config.derived import attention
from finetune.config import formats as source_formats
from finetune.config.inputs import Input, Output
from finetune.config.method_sections import (ClassifySection, DistillSection, DPOSection,
                                             KTOSection, PPOSection, RewardsSection)
from finetune.config.vision_section import VisionSection
from finetune.config.script_values import (MAX_LENGTH, MAX_MACHINES, MAX_PROCESSES,
                                    MAX_PROCESSES_PER_MACHINE, host_problem)
from finetune.errors import clip, shown
from finetune.config.section import (Section, by_method, check_no_control, check_repo_id,
                                     check_revision, for_methods)

Method = Literal[methods.NAMES]  # type: ignore[valid-type]


class ModelSection(Section):
    name_or_path: Annotated[str, Input("model")] = Field(
        description="Hub model id (org/name) or a local directory, relative to the YAML file.")
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description="'pretrained' loads weights; 'random' builds the architecture from "
        "config.json with freshly initialised weights (seeded by training.seed).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    _revision = field_validator("revision")(classmethod(lambda cls, v: check_revision(v)))
    trust_remote_code: bool = Field(
        False, description="Run modelling code shipped with the model. Off unless you trust it.")
    attn_implementation: str = Field(
        "auto", description="Attention kernel, any name transformers accepts (eager, sdpa, "
        "flex_attention, flash_attention_2/3/4, a hub kernel id org/repo[:function]) or "
        "finetune_varlen (PyTorch's flash varlen kernel). 'auto': flash_attention_2 on CUDA "
        "when flash_attn is installed, else finetune_varlen on CUDA in bf16/fp16, else sdpa.")

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, value: str) -> str:
        problem = attention.check_name(value)
        if problem:
            raise ValueError(problem)
        return value


class TokenizerSection(Section):
    name_or_path: Annotated[str | None, Input("model")] = Field(
        None, description="Tokenizer to load; defaults to model.name_or_path.")
    chat_template: Annotated[str | None, Input("template")] = Field(
        None, description="A Jinja chat template, inline or as a path to a .jinja file; "
        "replaces the tokenizer's own.")
    pad_token: str | None = Field(
        None, description="Padding token; defaults to the tokenizer's, else its EOS token.")


class PeftSection(Section):
    type: Literal["none", "lora", "qlora"] = Field(
        "none", description="none: full fine-tuning; lora: LoRA adapters; qlora: LoRA on a "
        "model quantized with bitsandbytes.")
    r: int = Field(16, gt=0, le=65536, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling alpha.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear', a module-name regex, or a list of module names.")
    modules_to_save: list[str] | None = Field(
        None, description="Extra modules trained in full and saved with the adapter.")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases train.")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA scaling.")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    bits: Literal[4, 8] = Field(4, description="qlora only: quantization bits.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="qlora only, 4-bit: data type.")
    double_quant: bool = Field(True, description="qlora only, 4-bit: quantize the scales too.")

    QLORA_ONLY: ClassVar[tuple[str, ...]] = ("bits", "quant_type", "double_quant")
    LORA_ONLY: ClassVar[tuple[str, ...]] = ("r", "alpha", "dropout", "target_modules", "modules_to_save", "bias",
                 "use_rslora", "use_dora")


class DataSource(Section):
    SHORTHAND: ClassVar[str] = "path"  # a bare string stands for {path: ...}
    path: Annotated[str, Input("data")] = Field(
        description="A local .json/.jsonl/.csv/.parquet file, or a .txt of plain text (`text` "
        "rows; see docs/data.md), relative to the YAML file; a directory of them, or a hub "
        "dataset id.")
    split: str = Field("train", description="Split to read from a hub dataset.")
    subset: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(None, description="Hub dataset revision.")
    _revision = field_validator("revision")(classmethod(lambda cls, v: check_revision(v)))
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Rename columns, as {expected_name: name_in_the_file}, e.g. "
        "{messages: conversations}.")
    data_files: str | list[str] | None = Field(
        None, description="Hub datasets only: the file(s) of the repository to read (names "
        "or glob patterns, as datasets' load_dataset takes them).")
    max_samples: int | None = Field(
        None, gt=0, le=2**63 - 1, description="Keep a random sample of N rows (seeded by "
        "data.seed; all rows when the source has N or fewer), in the file's order.")
    weight: float | None = Field(
        None, gt=0, le=1e6, description="This source's share of the mix, relative to the "
        "other sources' weights (given for every source of the list or for none). The mix "
        "keeps the total (the sum of the sources' rows after max_samples) and gives source "
        "i round(total x weight_i / sum of weights) rows: a random sample of a larger "
        "source, repeats plus a random sample of a smaller one (oversampling).")


def _as_source_list(value: Any) -> Any:
    """Accept `path`, {path: ...} or a list of either."""
    if value is None:
        return value
    items = value if isinstance(value, list) else [value]
    return [{"path": item} if isinstance(item, str) else item for item in items]


DataFormat = Literal[("auto",) + methods.formats() + tuple(source_formats.SOURCES)]  # type: ignore[valid-type]


class DataSection(Section):
    train: list[DataSource] = Field(description="Training data: one source or a list.")
    eval: list[DataSource] | None = Field(
        None, description="Held-out data: one source or a list. Exclusive with eval_fraction.")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="Hold out this fraction of the training rows "
        "(shuffled with training.seed) when no eval data is given.")
    format: DataFormat = Field(
        "auto", description="Row format; 'auto' detects it from the columns. "
        + by_method(lambda m: methods.spoken(m.formats, "or"))
        + ". classification rows are text and label; prompt rows a prompt (text or "
        "messages) plus any columns the reward functions read; unpaired_preference rows a "
        "prompt, a completion and a boolean label (true: desirable), and kto reads "
        "preference pairs as two such rows each. Converted while reading: "
        "alpaca (instruction, optional input and system, output: prompt/completion messages "
        "for sft, a prompt for grpo and ppo), sharegpt (conversations of from/value turns: "
        "messages, for sft) and labelled_messages (messages and a boolean label: unpaired "
        "rows for kto, the last assistant turn as the completion); 'auto' detects them too "
        "where no other format's columns are there.")
    roles: dict[str, str] = Field(
        default_factory=dict, description="sharegpt: speaker names (`from`) and the role each "
        "becomes (system, user, assistant or tool), over the usual ones: "
        + ", ".join(f"{k}: {v}" for k, v in source_formats.SHAREGPT_ROLES.items()) + ".")
    seed: int | None = Field(
        None, ge=0, le=2**32 - 1, description="Seed of the sources' sampling (max_samples, "
        "weight); default training.seed. The same seed gives the same rows on every rank "
        "and every run.")
    weight_column: str | None = Field(
        None, description=for_methods(lambda m: m.weights) + "a numeric column of per-sample "
        "loss weights (>= 0 and <= 1e6: weights are relative, so scale larger ones down). The loss "
        "is sum(w x loss) / sum(w) over the global batch, the same under gradient "
        "accumulation and data parallelism. sft messages may also carry a `weight` on "
        "assistant messages (same bounds): a per-token weight for that turn's tokens.")

    streaming: bool = Field(
        False, description="sft on text rows (continued pretraining): read the local "
        "training files lazily, row by row, tokenize and pack them to training.max_length "
        "blocks on the fly, never holding the data in memory nor caching it. Needs "
        "training.max_steps and training.packing; the files are read in order, again and "
        "again until max_steps (weighted sources interleaved at random, seeded by "
        "data.seed); a resumed run re-reads the stream up to its step, so it trains on "
        "exactly what an uninterrupted run would. Eval data (data.eval) is read whole.")
    cache: bool = Field(
        True, description="Cache the prepared (validated, tokenized) data on disk, keyed by "
        "the data files, tokenizer and settings: the other ranks and later runs reuse it.")
    cache_dir: Annotated[str | None, Output()] = Field(
        None, description="Where the data cache lives; default .data-cache next to the run "
        "directory (runs/.data-cache). On several machines, a shared directory makes one "
        "machine tokenize for all; a local one makes each machine tokenize once.")

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        return _as_source_list(value)

    @field_validator("train", "eval")
    @classmethod
    def _weights(cls, value: list[DataSource] | None) -> list[DataSource] | None:
        weighted = [source.weight is not None for source in value or []]
        if any(weighted) and not all(weighted):
            missing = ", ".join(str(i) for i, w in enumerate(weighted) if not w)
            raise ValueError(f"weight is given for some sources and not for source(s) "
                             f"{missing}: give every source of the list a weight, or none")
        return value

    @field_validator("roles")
    @classmethod
    def _roles(cls, value: dict[str, str]) -> dict[str, str]:
        wrong = {k: v for k, v in value.items() if v not in source_formats.ROLES}
        if wrong:
            named = ", ".join(f"{clip(k)}: {shown(v)}" for k, v in wrong.items())
            raise ValueError(f"{named}: a role is one of {', '.join(source_formats.ROLES)}")
        return value


class EvaluationSection(Section):
    before_training: bool = Field(
        True, description="Evaluate once before training, so the summary shows the change.")
    exact_match: bool = Field(
        False, description=for_methods(lambda m: m.exact_match) + "greedy-generate answers "
        "for the eval prompts and report the fraction that equals the reference exactly "
        "(after stripping whitespace).")
    max_new_tokens: int = Field(64, gt=0, le=MAX_LENGTH,
                                description="exact_match: generation length limit.")
    max_samples: int = Field(256, gt=0, le=MAX_LENGTH,
                             description="exact_match: eval rows to generate for.")


class DeepSpeedSection(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage.")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where optimizer states live (ZeRO 1-3).")
    offload_params: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where parameters live between uses (ZeRO-3 only).")
    nvme_path: Annotated[str | None, Output()] = Field(
        None, description="Directory for nvme offload.")
    save_16bit_model: bool = Field(
        True, description="ZeRO-3: gather the weights into one 16/32-bit model when saving.")
    config_file: Annotated[str | None, Input("file")] = Field(
        None, description="A hand-written DeepSpeed JSON to use instead of the generated one; "
        "checked against the experiment (stage, precision, batch, accumulation, clipping).")

    _paths = field_validator("nvme_path", "config_file")(
        classmethod(lambda cls, v: check_no_control(v)))


class FSDPSection(Section):
    version: Literal[1, 2] = Field(2, description="FSDP version.")
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = Field(
        "FULL_SHARD", description="What is sharded across processes.")
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP", description="How modules are wrapped into FSDP units.")
    cpu_offload: bool = Field(False, description="Keep parameters on the CPU between uses.")
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT", description="Checkpoint format; the final model is always full.")


class DistributedSection(Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' uses CUDA when available, else the CPU.")
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = Field(
        "none", description="none: one process; ddp: data parallel; fsdp or deepspeed: "
        "sharded data parallel.")
    num_machines: int = Field(1, ge=1, le=MAX_MACHINES, description="Machines (nodes) in the job.")
    num_processes: int | None = Field(
        None, ge=1, le=MAX_PROCESSES, description="Processes in total, over all machines. Default: "
        "processes_per_machine x num_machines, or 1 with strategy none.")
    processes_per_machine: int | None = Field(
        None, ge=1, le=MAX_PROCESSES_PER_MACHINE, description="Processes on each machine (usually its GPU count).")
    main_process_ip: str = Field("127.0.0.1", description="Address of machine 0.")
    main_process_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port.")
    rdzv_backend: Literal["static", "c10d"] = Field("static", description="Rendezvous backend.")
    rdzv_timeout: int = Field(
        120, gt=0, le=7 * 24 * 3600, description="Seconds a process waits for the others to join before it "
        "fails with an error.")
    launcher: Literal["accelerate", "torchrun"] = Field(
        "accelerate", description="What `finetune launch` starts the processes with.")
    tensor_parallel: int = Field(
        1, ge=1, le=MAX_PROCESSES, description="Processes that split each layer's weights "
        "between them (DeepSpeed AutoTP: strategy deepspeed, ZeRO stage 0-2, method sft, "
        "full fine-tuning). The data parallel degree is num_processes / tensor_parallel.")
    sequence_parallel: int = Field(
        1, ge=1, le=MAX_PROCESSES, description="Processes that split each row along the "
        "sequence and share its attention heads (DeepSpeed ALST/Ulysses: strategy deepspeed, "
        "ZeRO 1-2, method sft, full fine-tuning, padded batches, sdpa or flash attention). The "
        "data parallel degree is num_processes / sequence_parallel.")
    context_parallel: int = Field(
        1, ge=1, le=MAX_PROCESSES, description="Processes that split each row for ring "
        "attention (accelerate's torch context parallelism, written into the Accelerate "
        "file: strategy fsdp version 2, CUDA, `finetune launch`, method sft, sdpa, padded "
        "rows; not verified by finetune, which has no GPUs). The FSDP shard degree is "
        "num_processes / context_parallel.")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    fsdp: FSDPSection = Field(default_factory=FSDPSection)

    @field_validator("main_process_ip")
    @classmethod
    def _host(cls, value: str) -> str:
        problem = host_problem(value)  # it is written into launch.sh
        if problem:
            raise ValueError(problem)
        return value

    @property
    def world_size(self) -> int:
        if self.num_processes is not None:
            return self.num_processes
        return (self.processes_per_machine or 1) * self.num_machines

    @property
    def counted(self) -> bool:
        """The experiment gives its process count (else the launcher's is taken)."""
        return self.num_processes is not None or self.processes_per_machine is not None

    @property
    def per_machine(self) -> int:
        return self.world_size // self.num_machines

    @property
    def data_parallel(self) -> int:
        """Processes that each see their own batch: a tensor- or sequence-parallel group
        shares one."""
        split = self.tensor_parallel * self.sequence_parallel * self.context_parallel
        return max(self.world_size // split, 1)


class OutputSection(Section):
    dir: Annotated[str | None, Output()] = Field(
        None, description="Run directory; default runs/<name> under the current directory.")
    save_final: bool = Field(True, description="Save the final model or adapter to <dir>/final.")
    plot: bool = Field(True, description="Write the loss curve to <dir>/loss.png.")
    hub_model_id: str | None = Field(
        None, description="Hub repository (org/name, or a name under your account) that "
        "training.push_to_hub uploads the final model to, with a model card; default: the "
        "run name.")

    _dir = field_validator("dir")(classmethod(lambda cls, v: check_no_control(v)))
    _hub_model_id = field_validator("hub_model_id")(classmethod(lambda cls, v: check_repo_id(v)))


class PreemptionSection(Section):
    save_timeout: int = Field(
        300, gt=0, le=7 * 24 * 3600, description="Seconds a save asked for by SIGTERM or SIGUSR1 may take; "
        "past them the process exits without it (the previous checkpoint stays). Keep it "
        "below the cluster's grace period (SLURM: KillWait or the preemption GraceTime).")


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Experiment(Section):
    name: str = Field(description="Run name; the run directory is runs/<name> by default.")
    method: Method = Field(description="Training method.")
    model: ModelSection
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    peft: PeftSection = Field(default_factory=PeftSection)
    data: DataSection
    vision: VisionSection | None = Field(
        None, description="Vision-language models only: the tower, the projector, the image "
        "sizes (docs/vision.md).")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Mixed precision for the whole run. 'auto': bf16 where the GPU "
        "supports it, fp16 on older GPUs, fp32 on CPU.")
    training: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to the method's config class (" + by_method(
            lambda m: ".".join(m.config_class)) + "): any of its fields under its own name.")
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    dpo: DPOSection = Field(default_factory=DPOSection)
    kto: KTOSection = Field(default_factory=KTOSection)
    classify: ClassifySection | None = Field(
        None, description="method classify: labels, class weights, focal loss, smoothing.")
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    ppo: PPOSection = Field(default_factory=PPOSection)
    distill: DistillSection | None = Field(
        None, description=for_methods(lambda m: "distill" in m.sections) + "the teacher "
        "model.")
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output: OutputSection = Field(default_factory=OutputSection)
    resume: Annotated[str, Input("checkpoint", relative_to="cwd")] = Field(
        "auto", description="'auto': continue from the newest complete checkpoint of the run "
        "directory, or start fresh if it has none; 'never': start fresh, and refuse a run "
        "directory that already holds checkpoints; or the path of a checkpoint directory "
        "(checkpoint-<step>) to continue from.")
    force_resume: bool = Field(
        False, description="Resume even though the experiment differs from the checkpoint's "
        "in what it trains (model, data, method, seed, global batch...).")
    preemption: PreemptionSection = Field(default_factory=PreemptionSection)

    @field_validator("resume")
    @classmethod
    def _resume(cls, value: str) -> str:
        if not value:
            raise ValueError("use auto, never, or the path of a checkpoint directory")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):  # match() lets "abc\n" through
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a "
                             "letter or digit")
        return value
