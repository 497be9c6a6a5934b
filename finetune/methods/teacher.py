"""The frozen teacher of the distillation methods (distill, gkd): distill.teacher loaded
in the reference model's dtype (config/derived/effective.py model_precision, role teacher): a
model directory or hub id, or a finetune run directory whose final/ model or adapter
model/saved.py loads as generate and chat do. Its vocabulary must be the student's:
checked as it loads."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import ConfigError, first_line
from finetune.config.schema import Experiment
from finetune.methods import Job

WHERE = "distill.teacher"


def _load(experiment: Experiment, dtype):
    """(model, its tokenizer or None) of distill.teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = experiment.distill.teacher
    trust = experiment.model.trust_remote_code
    if (Path(source) / "experiment.yaml").is_file():  # a finetune run: its final/
        from finetune.model.saved import load_model, load_tokenizer, locate

        run = locate(source)
        if run.head != "lm":
            raise ConfigError([f"{WHERE}: {source} is a {run.experiment.method} run: its "
                               "model scores text and has no next-token distribution"])
        if run.vision:
            raise ConfigError([f"{WHERE}: {source} is a vision-language model: a teacher "
                               "that takes images is not supported yet"])
        tokenizer = load_tokenizer(run)
        return load_model(run, tokenizer, dtype, "cpu"), tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{WHERE}: cannot load {source!r} as a causal LM: "
                           f"{first_line(exc)}"]) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except (OSError, ValueError):
        tokenizer = None  # a model without its tokenizer: the vocabulary size still checks
    return model, tokenizer


def _vocabulary_problem(student, student_tokenizer, teacher, teacher_tokenizer) -> str | None:
    """Why the teacher's next-token distribution is not over the student's tokens."""
    ours = student.config.get_text_config().vocab_size
    theirs = teacher.config.get_text_config().vocab_size
    if ours != theirs:
        return (f"the teacher's vocabulary has {theirs} entries (vocab_size), the student's "
                f"{ours}")
    if teacher_tokenizer is not None:
        mine, other = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
        differ = sorted(t for t in mine.keys() | other.keys() if mine.get(t) != other.get(t))
        if differ:
            return (f"the teacher's tokenizer maps {len(differ)} token(s) differently from "
                    f"the student's (first: {differ[0]!r})")
    return None


def teacher_model(job: Job):
    spec = job.experiment
    teacher, tokenizer = _load(spec, job.hardware.model_dtype(spec, "teacher"))
    problem = _vocabulary_problem(job.model, job.tokenizer, teacher, tokenizer)
    if problem:
        raise ConfigError([f"{WHERE}: {problem}; distillation compares the two next-token "
                           "distributions, so the teacher must share the student's "
                           "tokenizer (same family of models)"])
    teacher.requires_grad_(False)
    return teacher.eval()
