"""What a vision-language model (config/vision.py) trains with so far: the methods whose
record says `vision` (sft, dpo, kto, grpo, rloo and distill, from a vision-language
teacher), whole or with (Q)LoRA, rows collated padded; and the `vision:` section, which
only such a model takes. Known from a local model's config.json; a hub model's is read
at training (methods/sft_vision.py, methods/dpo.py, methods/kto.py, methods/online.py,
methods/teacher.py and model/vision_parts.py refuse the same settings there)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from finetune.config import vision
from finetune.config.methods import method, names_where, spoken
from finetune.config.schema import Experiment

Problem = tuple[tuple, str]

# Model types that read their pictures through cross-attention, with inputs some of TRL's
# trainers do not carry: GRPOTrainer and RLOOTrainer drop aspect_ratio_ids and
# cross_attention_mask, DistillationTrainer passes a fixed list of keys, none of
# mllama's, and KTO's vision collator keeps the prompt's mask beside prompt +
# completion (the forward fails; TRL 1.16). sft's collator renders whole conversations
# through the processor; dpo's mask is built again for prompt + answer
# (methods/dpo.MllamaPairs).
CROSS_ATTENTION = {"mllama": "Llama 3.2 Vision (model_type mllama)"}
# Model types whose attention sees the prompt both ways (token_type_ids 0) and the answer
# causally (1): only sft's plain prompt/completion collator lays that out
# (methods/sft_plain_vision.py); TRL 1.16's other vision collators encode answers through
# a processor that refuses text without pictures, and mark them 0 (seen both ways).
PREFIX_LM = {"paligemma": "PaliGemma (model_type paligemma)"}
PREFIX_TRAINED = ("false would train PaliGemma's prefix, whose tokens each see the ones "
                  "after them (its attention over the prefix goes both ways): it trains its "
                  "suffix (the completion) only")


def method_refused(model_type: str | None, method_name: str) -> str | None:
    """Why this model type cannot train with this method (one line), or None. Validate
    says it for a local model, the trainer for any (trainers/vision.py)."""
    why = _why(model_type, method_name)
    if why is None:
        return None
    takers = spoken(names_where(lambda m: m.vision and _why(model_type, m.name) is None))
    name = {**CROSS_ATTENTION, **PREFIX_LM}[model_type]
    return f"{name} trains with {takers} only yet: {why} (docs/vision.md)"


def _why(model_type: str | None, method_name: str) -> str | None:
    if model_type in PREFIX_LM and method_name != "sft":
        return (f"TRL 1.16's {method_name} collator does not lay out its prefix (prompt, "
                "attended both ways) and suffix (answer, causal)")
    if model_type not in CROSS_ATTENTION:
        return None
    if method(method_name).generates:
        return f"TRL 1.16's {method_name} trainer does not carry its cross-attention inputs"
    if method_name == "kto":
        return ("TRL 1.16's kto collator keeps the prompt's cross-attention mask beside "
                "prompt + completion")
    return None


def teacher_refused(student_sees: bool, teacher_sees: bool, teacher: str) -> str | None:
    """Why distill.teacher cannot teach this student (one line), or None: the teacher
    scores the student's completions after the student's prompts, pictures included, so
    it takes pictures exactly when the student does. A text teacher of a VLM would
    judge answers about pictures it never saw. Validate says it for local models,
    methods/teacher.py at training for any."""
    if student_sees and not teacher_sees:
        return (f"{teacher} is a text model and the student a vision-language one: it "
                "would score answers about pictures it cannot see; give a vision-language "
                "teacher of the student's family (same processor)")
    if teacher_sees and not student_sees:
        return (f"{teacher} is a vision-language model and the student a text one: a "
                "teacher that takes pictures teaches a vision-language student (method "
                "distill) only")
    return None


def check(exp: Experiment) -> Iterator[Problem]:
    yield from _section(exp)
    yield from _teacher(exp)
    if not vision.is_vision_language(exp.model.name_or_path):
        return
    what = f"{exp.model.name_or_path} is a vision-language model"
    if not method(exp.method).vision:
        takers = names_where(lambda m: m.vision)
        verb = "trains" if len(takers) == 1 else "train"
        yield ("method",), f"{what}: only {spoken(takers)} {verb} one yet (docs/vision.md)"
    else:
        refused = method_refused(vision.model_type(exp.model.name_or_path), exp.method)
        if refused:
            yield ("method",), refused
    if vision.model_type(exp.model.name_or_path) in PREFIX_LM and \
            exp.training.get("completion_only_loss") is False:
        yield ("training", "completion_only_loss"), PREFIX_TRAINED
    for key in ("packing", "padding_free"):
        if exp.training.get(key):
            yield ("training", key), f"{what}: rows with images are collated padded, one " \
                                     "row per sequence (TRL's vision collator)"
    yield from _collated(exp, what)


def _teacher(exp: Experiment) -> Iterator[Problem]:
    """A local distill.teacher against a local student (teacher_refused)."""
    teacher = getattr(getattr(exp, "distill", None), "teacher", None)
    student = vision.model_type(exp.model.name_or_path)
    if teacher is None or student is None:
        return
    run_final = Path(teacher) / "final"  # a finetune run: its final/ model
    found = vision.model_type(str(run_final if (Path(teacher) / "experiment.yaml").is_file()
                                  else teacher))
    if found is None:  # a hub id or an adapter: said at training
        return
    types = vision.image_text_model_types()
    refused = teacher_refused(student in types, found in types, teacher)
    if refused:
        yield ("distill", "teacher"), refused


def _collated(exp: Experiment, what: str) -> Iterator[Problem]:
    """What TRL's vision collators and DPOTrainer refuse for rows with images
    (methods/sft_vision.py and methods/dpo.py say the same at training)."""
    training = exp.training
    if training.get("truncation_mode") == "keep_end":
        yield ("training", "truncation_mode"), f"{what}: keep_end would cut the image " \
                                              "tokens off the prompt; rows with images are " \
                                              "cut at the end (keep_start)"
    if training.get("precompute_ref_log_probs"):
        yield ("training", "precompute_ref_log_probs"), f"{what}: not supported (TRL " \
                                                        "renders its rows batch by batch)"
    pairs = "preference" in method(exp.method).formats  # dpo, kto
    if training.get("pad_to_multiple_of") is not None and pairs:
        yield ("training", "pad_to_multiple_of"), f"{what}: not supported (TRL's vision " \
                                                  "preference collators do not pad to it)"
    sizes = exp.vision
    if method(exp.method).generates and sizes is not None:
        for key in ("max_pixels", "min_pixels"):
            if getattr(sizes, key) is not None:
                yield ("vision", key), f"not supported for {exp.method} yet (its trainer " \
                                       "opens the pictures itself): fit the pictures ahead"


def _section(exp: Experiment) -> Iterator[Problem]:
    spec = exp.vision
    if spec is None:
        return
    found = vision.model_type(exp.model.name_or_path)
    if found is not None and found not in vision.image_text_model_types():
        yield ("vision",), f"model.name_or_path {exp.model.name_or_path} is not a " \
                           f"vision-language model (model_type {found}): remove this section"
        return
    if spec.min_pixels is not None and spec.max_pixels is not None and \
            spec.min_pixels > spec.max_pixels:
        yield ("vision", "min_pixels"), f"{spec.min_pixels} is more than vision.max_pixels " \
                                        f"{spec.max_pixels}"
