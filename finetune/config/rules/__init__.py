"""Every rule validate checks beyond one field's type, in this package: RULES (below) lists
them, this module's own cross-field rules and those of its modules: value ranges the
libraries would refuse only at training (values.py), tensor parallelism (parallel.py),
sequence and context parallelism (sequence.py), what a model directory or hub id allows
(models.py), what trackers and the hub need from this machine (integrations.py), a
hand-written DeepSpeed file against the experiment (deepspeed_file.py), what a
vision-language model trains with (vision.py). Each rule returns
(loc, problem) pairs; imports no torch."""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from finetune.config import fused_experts, inputs, paths
from finetune.config.rules import deepspeed_file, models, parallel, sequence, values, vision
from finetune.config.formats import accepted as accepted_formats, trained
from finetune.config.derived.effective import record, value
from finetune.config.methods import names_where, sections, spoken
from finetune.config.schema import Experiment, PeftSection
from finetune.config.secrets import CREDENTIALS, is_secret
from finetune.errors import shown

Problem = tuple[tuple, str]

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
FUNCTION_RE = re.compile(r"^(?:[A-Za-z_][\w.]*|.+\.py):[A-Za-z_]\w*$")


def is_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or paths.exists(path)


def _did_you_mean(path: str) -> str:
    """'; did you mean NAME?' for a missing file one letter or two from a file beside it."""
    parent = Path(path).parent
    try:
        names = [p.name for p in parent.iterdir() if paths.is_file(p)] if paths.is_dir(parent) \
            else []
    except OSError:
        return ""
    close = difflib.get_close_matches(Path(path).name, names, n=1, cutoff=0.8)
    return f"; did you mean {parent / close[0]}?" if close else ""


def _paths(exp: Experiment) -> Iterator[Problem]:
    for loc, path in inputs.values(exp, "data"):
        source = getattr(exp.data, loc[1])[loc[2]]  # loc: ("data", split, i, "path")
        bad = paths.problem(path)
        if bad:
            yield loc, bad
        elif is_local(path):
            if source.data_files is not None:
                yield (loc[:-1] + ("data_files",),
                       "only for hub datasets; a local source names its files in path "
                       "(a file, or a directory of them)")
            if not paths.exists(path):
                yield loc, f"no such file or directory: {path}{_did_you_mean(path)}"
            elif not (paths.is_file(path) or paths.is_dir(path)):
                # A FIFO, socket or device: reading it would block or never end.
                yield loc, f"not a regular file or directory: {path}"
        elif path.lower().endswith(DATA_SUFFIXES):
            yield loc, f"no such file: {path} (relative paths are relative to " \
                       "the YAML file that names them)"
        elif not HUB_ID.fullmatch(path):
            yield loc, f"neither a local file nor a hub dataset id: {shown(path)}"
        else:
            yield from models.offline(loc, path, "dataset")
    for loc, value in inputs.values(exp, "model"):  # distill.teacher: _distill
        bad = paths.problem(value)
        if bad:
            yield loc, bad
        elif is_local(value):
            if not paths.is_dir(value):
                yield loc, f"no such model directory: {value}"
            elif loc[0] == "model" and not paths.is_file(Path(value) / "config.json"):
                yield loc, f"{value} has no config.json"
            elif loc[0] == "model":
                yield from models.remote_code(loc, value, exp.model.trust_remote_code)
        elif not HUB_ID.fullmatch(value):
            yield loc, f"neither a local directory nor a hub id: {shown(value)}"
        else:
            revision = exp.model.revision if loc[0] == "model" else None
            yield from models.on_hub(loc, value, revision)
    tokenizer = exp.tokenizer.name_or_path or exp.model.name_or_path
    if exp.tokenizer.pad_token and not paths.problem(tokenizer) and paths.is_dir(tokenizer):
        yield from models.pad_token(("tokenizer", "pad_token"), tokenizer, exp.tokenizer.pad_token)
    template = exp.tokenizer.chat_template
    if template and "{{" not in template and "{%" not in template and \
            not paths.is_file(template):
        yield ("tokenizer", "chat_template"), f"neither a Jinja template nor a file: {shown(template)}"


def changed(section: BaseModel) -> set[str]:
    """Fields set to something other than their default. A resolved experiment spells
    out every default, so "was it given?" must mean "does it differ?"."""
    return {name for name, field in type(section).model_fields.items()
            if getattr(section, name) != field.get_default(call_default_factory=True)}


def _peft(exp: Experiment) -> Iterator[Problem]:
    given = changed(exp.peft)
    if exp.peft.type != "qlora":
        for name in sorted(given & set(PeftSection.QLORA_ONLY)):
            yield ("peft", name), f"only applies to peft.type qlora (type is {exp.peft.type})"
    if exp.peft.type == "none":
        for name in sorted(given & set(PeftSection.LORA_ONLY)):
            yield ("peft", name), "only applies to peft.type lora or qlora (type is none)"


def _methods(wanted) -> str:
    """'method sft' or 'methods grpo and ppo': those whose record satisfies wanted(record)."""
    names = names_where(wanted)
    return f"method{'s' if len(names) > 1 else ''} {spoken(names)}"


def _data(exp: Experiment) -> Iterator[Problem]:
    own = record(exp)
    if exp.data.eval is not None and exp.data.eval_fraction is not None:
        yield ("data", "eval_fraction"), "give data.eval or data.eval_fraction, not both"
    accepted = ("auto",) + accepted_formats(own.formats)
    if exp.data.format not in accepted:
        yield ("data", "format"), f"method {exp.method} takes {', '.join(accepted)}"
    has_eval = exp.data.eval is not None or exp.data.eval_fraction is not None
    if value(exp, "eval_strategy") != "no" and not has_eval:
        yield ("training", "eval_strategy"), "needs held-out data: set data.eval or " \
                                             "data.eval_fraction"
    if exp.evaluation.exact_match:
        if not own.exact_match:
            yield ("evaluation", "exact_match"), f"only for {_methods(lambda m: m.exact_match)}"
        elif trained(exp.data.format, own.formats) == "text":
            yield ("evaluation", "exact_match"), "needs prompts and answers, not format text"
        if not has_eval:
            yield ("evaluation", "exact_match"), "needs data.eval or data.eval_fraction"
    if exp.data.weight_column is not None and not own.weights:
        why = ": its samples are weighted by their rewards" if own.rewarded else \
            f": its trainer has no per-sample loss weights (they are for " \
            f"{_methods(lambda m: m.weights)})"
        yield ("data", "weight_column"), f"not used by method {exp.method}{why}"
    yield from _tokenization(exp)
    yield from _streaming(exp)


def _streaming(exp: Experiment) -> Iterator[Problem]:
    """data.streaming: a lazily read, packed stream of text rows for sft (data/stream.py)."""
    if not exp.data.streaming:
        return
    here = ("data", "streaming")
    setting = lambda key: value(exp, key, default=None)
    if "text" not in record(exp).formats:
        yield here, f"streams text rows (continued pretraining), for " \
                    f"{_methods(lambda m: 'text' in m.formats)}; method {exp.method} " \
                    "reads its data whole"
    elif exp.data.format not in ("auto", "text"):
        yield here, f"streams text rows only; data.format is {exp.data.format}"
    if (setting("max_steps") or -1) <= 0:
        yield here, "needs training.max_steps: a stream has no length to count epochs in"
    if not setting("packing"):
        yield here, "needs training.packing: true (the stream is packed into max_length " \
                    "blocks as it is read)"
    if setting("shuffle_dataset"):
        yield ("training", "shuffle_dataset"), "not with data.streaming: the stream is read " \
                                               "in order (interleaved at random by weight)"
    if exp.data.eval_fraction is not None:
        yield ("data", "eval_fraction"), "not with data.streaming (a stream cannot be split " \
                                         "without reading it all): give data.eval"
    for i, source in enumerate(exp.data.train):
        if not is_local(source.path):
            yield ("data", "train", i, "path"), "data.streaming reads local files; this is a " \
                                                "hub dataset"
        if source.max_samples is not None:
            yield ("data", "train", i, "max_samples"), "not with data.streaming (a sample " \
                "needs the source's length); the stream is cut by training.max_steps"


def _tokenization(exp: Experiment) -> Iterator[Problem]:
    """Settings of the rows' tokenization (the keys exist only where they apply)."""
    setting = lambda key: value(exp, key, default=None)
    fmt = exp.data.format  # alpaca (prompt/completion messages) is conversational
    if setting("assistant_only_loss") and fmt in ("text", "prompt_completion"):
        yield ("training", "assistant_only_loss"), "needs conversational data (format messages)"
    for name in ("packing", "padding_free"):
        if exp.data.weight_column and setting(name):
            yield ("training", name), "not supported with loss weights (data.weight_column)"
    if record(exp).tokenizes:  # finetune truncates (data/sft_tokens.py): its two modes
        mode = setting("truncation_mode") or "keep_start"
        if mode not in ("keep_start", "keep_end"):
            yield ("training", "truncation_mode"), f"{shown(mode)} is not keep_start or keep_end"
    if setting("packing") and "max_length" in exp.training and exp.training["max_length"] is None:
        yield ("training", "packing"), "needs training.max_length (the packed length)"
    if setting("completion_only_loss") and \
            trained(fmt, record(exp).formats) in ("text", "messages"):
        yield ("training", "completion_only_loss"), "needs prompt/completion data; for " \
                                                    "messages use assistant_only_loss"


def _precision(exp: Experiment) -> Iterator[Problem]:
    if exp.precision == "fp16" and exp.distributed.device == "cpu":
        yield ("precision",), "fp16 needs a CUDA device; on CPU use fp32 or bf16"


def _method_sections(exp: Experiment) -> Iterator[Problem]:
    own = record(exp)
    for section in sections():
        given = getattr(exp, section)
        if section not in own.sections and given is not None and changed(given):
            owners = _methods(lambda m: section in m.sections)
            yield (section,), f"options for {owners}, but method is {exp.method}"
    for section in own.sections:
        if getattr(exp, section) is None:
            yield (section,), f"method {exp.method} needs {_required(section)}"


def _required(section: str) -> str:
    """The keys of an optional section that have no default, as section.key."""
    annotation = Experiment.model_fields[section].annotation
    model = next(a for a in typing.get_args(annotation)
                 if isinstance(a, type) and issubclass(a, BaseModel))
    return ", ".join(f"{section}.{name}" for name, field in model.model_fields.items()
                     if field.is_required())


def _rewards(exp: Experiment) -> Iterator[Problem]:
    if not record(exp).rewarded:
        return
    spec = exp.rewards
    if spec.model is None and not spec.functions:
        yield ("rewards",), f"method {exp.method} needs a reward: rewards.model and/or " \
                            "rewards.functions"
    for i, name in enumerate(spec.functions):
        if not FUNCTION_RE.fullmatch(name):
            yield ("rewards", "functions", i), f"{shown(name)}: write 'module:function' or " \
                                                "'file.py:function'"
        elif ".py:" in name and not paths.is_file(name.rpartition(":")[0]):
            yield ("rewards", "functions", i), f"no such file: {name.rpartition(':')[0]}"
    sources = (spec.model is not None) + len(spec.functions)
    if spec.weights is not None and len(spec.weights) != sources:
        yield ("rewards", "weights"), f"{len(spec.weights)} weights for {sources} reward " \
                                      "source(s) (the model first, then each function)"
    if exp.training.get("use_vllm"):  # GRPOConfig's
        yield ("training", "use_vllm"), "not supported: completions are generated by the trainer"


def _ppo(exp: Experiment) -> Iterator[Problem]:
    # Unset unless the method owns the section (_method_sections).
    if exp.ppo.value_model_path and exp.ppo.value_model == "shared":
        yield ("ppo", "value_model_path"), "only for value_model: separate"


def _classify(exp: Experiment) -> Iterator[Problem]:
    spec = exp.classify
    if "classify" not in record(exp).sections or spec is None:
        return
    if len(spec.labels) < 2:
        yield ("classify", "labels"), "at least two classes"
    if len(set(spec.labels)) != len(spec.labels):
        yield ("classify", "labels"), "class names repeat"
    weights = spec.class_weights
    if isinstance(weights, list):
        if len(weights) != len(spec.labels):
            yield ("classify", "class_weights"), f"{len(weights)} weights for " \
                                                 f"{len(spec.labels)} labels"
        if any(not w >= 0 for w in weights) or not any(w > 0 for w in weights):
            yield ("classify", "class_weights"), "weights must be >= 0, and not all 0"


def _distributed(exp: Experiment) -> Iterator[Problem]:
    dist = exp.distributed
    given = changed(dist)
    world = dist.world_size
    strategies = record(exp).strategies
    if dist.strategy not in strategies:
        yield ("distributed", "strategy"), f"{exp.method} runs with strategy " \
                                           f"{spoken(strategies, 'or')}"
    # strategy none over N > 1 processes is DDP (run/launched.parallel_note).
    if world % dist.num_machines:
        yield ("distributed", "num_processes"), f"{world} processes do not divide evenly over " \
                                                f"{dist.num_machines} machines"
    if dist.num_processes is not None and dist.processes_per_machine is not None and \
            dist.num_processes != dist.processes_per_machine * dist.num_machines:
        yield ("distributed", "num_processes"), "disagrees with processes_per_machine x " \
                                                "num_machines; give one of them"
    for name in ("deepspeed", "fsdp"):
        if name in given and dist.strategy != name:
            yield ("distributed", name), f"options for strategy {name}, but strategy is " \
                                         f"{dist.strategy}"
    ds = dist.deepspeed
    if ds.offload_params != "none" and ds.zero_stage != 3:
        yield ("distributed", "deepspeed", "offload_params"), "needs zero_stage 3"
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        yield ("distributed", "deepspeed", "offload_optimizer"), "needs zero_stage 1, 2 or 3"
    if "nvme" in (ds.offload_optimizer, ds.offload_params) and not ds.nvme_path:
        yield ("distributed", "deepspeed", "nvme_path"), "required for nvme offload"
    if ds.config_file and not paths.is_file(ds.config_file):
        yield ("distributed", "deepspeed", "config_file"), f"no such file: {ds.config_file}"
    elif ds.config_file and dist.strategy == "deepspeed":
        yield from _deepspeed_file(exp, ds.config_file)
    if dist.strategy == "fsdp" and dist.launcher == "torchrun":
        # FSDP is switched on through the generated Accelerate config, which torchrun skips.
        yield ("distributed", "launcher"), "strategy fsdp needs launcher accelerate"
    if dist.strategy == "fsdp" and dist.device == "cpu":
        # accelerate 1.15 turns FSDP on only for accelerator devices: on CPU (gloo) FSDP2
        # silently trains as DDP, FSDP1 stops with "no available devices found".
        yield ("distributed", "strategy"), "fsdp needs CUDA devices (accelerate runs FSDP " \
                                           "only on accelerators); on CPU use ddp or deepspeed"
    if dist.strategy == "fsdp" and dist.fsdp.version == 2 and \
            dist.fsdp.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD"):
        # FSDP2 always shards, over one mesh dimension here: no exact translation.
        yield ("distributed", "fsdp", "sharding_strategy"), \
            f"{dist.fsdp.sharding_strategy} needs fsdp version 1; version 2 takes FULL_SHARD " \
            "or SHARD_GRAD_OP"
    if exp.peft.type == "qlora" and (dist.strategy == "fsdp" or
                                     (dist.strategy == "deepspeed" and ds.zero_stage == 3)):
        yield ("peft", "type"), "qlora cannot be combined with FSDP or ZeRO-3 here; use " \
                                "ddp or ZeRO-2"


def _deepspeed_file(exp: Experiment, path: str) -> Iterator[Problem]:
    for problem in deepspeed_file.problems(exp, path):
        yield ("distributed", "deepspeed", "config_file"), problem


def _resume(exp: Experiment) -> Iterator[Problem]:
    if exp.resume not in ("auto", "never") and not paths.is_dir(exp.resume):
        yield ("resume",), f"no such checkpoint directory: {exp.resume} (auto, never, or a " \
                           "path relative to the current directory)"
    if exp.training.get("save_only_model") and exp.resume != "never":
        yield ("training", "save_only_model"), "checkpoints without optimizer, scheduler " \
            "and RNG state cannot continue a run exactly; set resume: never to use it"


def _strings(value, loc: tuple = ()) -> Iterator[tuple[tuple, str]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _strings(sub, loc + (key,))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _strings(sub, loc + (i,))
    elif isinstance(value, str):
        yield loc, value


def _credentials(exp: Experiment) -> Iterator[Problem]:
    """A password or token inside a URL would be written into the run directory (the
    resolved experiment, generated configs) and shown in logs: refused wherever it is.
    Secret keys (training.hub_token) are redacted instead."""
    for loc, value in _strings(exp.model_dump(mode="json")):
        if not is_secret(str(loc[-1])) and CREDENTIALS.search(value):
            yield loc, ("holds credentials in a URL (user:password@); they would be written "
                        "into the run directory: give them through the environment (HF_TOKEN, "
                        "~/.netrc) instead")


def _distill(exp: Experiment) -> Iterator[Problem]:
    """distill.teacher: a model directory (full or adapter), a finished run of a causal
    LM (its final/), or a hub id. The vocabulary is checked where the model loads."""
    for loc, teacher in inputs.values(exp, "teacher"):
        yield from _teacher(exp, loc, teacher)


def _teacher(exp: Experiment, loc: tuple, teacher: str) -> Iterator[Problem]:
    bad = paths.problem(teacher)
    if bad:
        yield loc, bad
    elif not is_local(teacher):
        if not HUB_ID.fullmatch(teacher):
            yield loc, f"neither a local directory nor a hub id: {shown(teacher)}"
        else:
            yield from models.on_hub(loc, teacher)
    elif not paths.is_dir(teacher):
        yield loc, f"no such model directory: {teacher}"
    elif paths.is_file(Path(teacher) / "experiment.yaml"):  # a finetune run directory
        final = Path(teacher) / "final"
        if not any(paths.is_file(final / name) for name in ("config.json", "adapter_config.json")):
            yield loc, f"{teacher} is a run directory with no final/ model yet: finish that " \
                       "run first"
    elif not any(paths.is_file(Path(teacher) / name)
                 for name in ("config.json", "adapter_config.json")):
        yield loc, f"{teacher} holds no model (neither config.json nor adapter_config.json)"
    elif paths.is_file(Path(teacher) / "config.json"):
        yield from models.remote_code(loc, teacher, exp.model.trust_remote_code)


RULES = (_credentials, _paths, _peft, _data, _precision, _method_sections, _rewards, _ppo,
         _classify, _distributed, parallel.check, sequence.check, _resume, values.check,
         _distill, vision.check, models.flattened_state, fused_experts.check)


def check(exp: Experiment) -> list[Problem]:
    return [problem for rule in RULES for problem in rule(exp)]
