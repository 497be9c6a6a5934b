"""Knowledge distillation through TRL's DistillationTrainer (the top-level, stable one).

On-policy: the student generates a completion from each prompt (sampled with
training.temperature, top_p, top_k; up to max_completion_length tokens), and is trained
to match the frozen teacher's next-token distribution on it, token by token, under the
generalized Jensen-Shannon divergence of training.beta (0: forward KL(teacher||student),
1: reverse KL, the default; 0.5: JSD), both distributions softened by the temperature.
That is GKD (trl.experimental.gkd) with lmbda 1; TRL 1.16 has no top-level trainer that
mixes in the data's own completions (GKD's lmbda < 1 or seq_kd), so the data gives prompts
only: prompt rows as they are, prompt/completion rows their prompt, conversations the
turns before their last assistant turn.

The teacher (distill.teacher) is loaded by methods/teacher.py, as for method gkd.

A vision-language student generates from prompts with pictures (`images`; a
conversation's pictures stay with its prompt, so none may sit in the answer the prompt
leaves out), each prompt measured with its image tokens and dropped when the context
cannot hold it with max_completion_length, as grpo's (methods/online.prepare_prompts). Its teacher is a vision-language model with the student's
processor: TRL 1.16's DistillationTrainer passes the same multimodal inputs
(pixel_values, ...) to the student's and the teacher's backbones (_compute_loss), so the
teacher scores each completion seeing the prompt's pictures.

Exact resume: the training order per epoch is methods/online.py's EpochOrder (as grpo's
and rloo's); the sampled completions then follow from the RNG state the checkpoint
restores.
"""

from __future__ import annotations

from datasets import Dataset
from trl import DistillationTrainer

from finetune.config.schema import Experiment
from finetune.data.images import IMAGES, image_parts
from finetune.data.load import ORIGIN, Splits
from finetune.errors import ConfigError, DataError
from finetune.methods import Job
from finetune.methods.online import EpochOrder, prepare_prompts
from finetune.methods.teacher import teacher_model
from finetune.model.vision import is_processor
from finetune.trainers.vision import VisionCheckpoints


def _prompt_of(row: dict, fmt: str) -> dict:
    """A prompt row: the prompt of prompt/completion, the turns before the last
    assistant turn of a conversation."""
    if fmt == "prompt_completion":
        return {"prompt": row["prompt"]}
    messages = row["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    prompt = messages[:last] if last is not None else messages
    if not prompt or prompt[-1]["role"] == "assistant":
        raise DataError(f"{row[ORIGIN]}: no prompt to distill from: the conversation has no "
                        "turn before its last assistant answer")
    if row.get(IMAGES) is None:
        return {"prompt": prompt}
    if image_parts(messages[len(prompt):]):
        raise DataError(f"{row[ORIGIN]}: an image part in the last assistant answer, which "
                        "distill leaves out (the student generates it): pictures belong to "
                        "the prompt")
    return {"prompt": prompt, IMAGES: row[IMAGES]}


def _prompts(rows: Dataset | None, fmt: str) -> Dataset | None:
    if rows is None or fmt == "prompt":
        return rows
    return Dataset.from_list([{**_prompt_of(row, fmt), ORIGIN: row[ORIGIN]} for row in rows])


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Prompt rows, each rendered and counted against the model's context: a text
    model's refused when too long, a vision-language model's, with its pictures, dropped
    and counted (as grpo's)."""
    if splits.format != "prompt":
        splits = Splits(train=_prompts(splits.train, splits.format),
                        eval=_prompts(splits.eval, splits.format), format=splits.format,
                        mix=splits.mix, notes=[*splits.notes, "distill: the student "
                        "generates its own completions; the data's are not used"])
    return prepare_prompts(splits, tokenizer, experiment)


class ResumableDistillationTrainer(EpochOrder, DistillationTrainer):
    """DistillationTrainer whose training order survives a resume (see the module doc)."""


class ResumableVisionDistillationTrainer(VisionCheckpoints, ResumableDistillationTrainer):
    """A vision-language student's: its checkpoints' weights loaded back (trainers/vision.py)."""


def build_trainer(job: Job) -> DistillationTrainer:
    if job.args.use_vllm:
        raise ConfigError(["training.use_vllm: not supported by finetune's distill "
                           "(generation runs in the trainer)"])
    trainer = ResumableVisionDistillationTrainer if is_processor(job.tokenizer) \
        else ResumableDistillationTrainer
    return trainer(
        model=job.model, teacher_model=teacher_model(job), args=job.args,
        train_dataset=job.data.train, eval_dataset=job.data.eval,
        processing_class=job.tokenizer, callbacks=job.callbacks)
