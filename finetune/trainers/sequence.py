"""SFT under sequence parallelism (DeepSpeed ALST/Ulysses) with the gradient one process
computes, its epochs and its exact resume.

Under Ulysses each rank of a sequence-parallel group holds a slice of every row, and
transformers' loss (integrations/deepspeed.py, deepspeed_sp_compute_loss) all-gathers the
slices' losses differentiably, so every rank's loss is the whole row's and its backward
sends each slice the sum of the group's gradients: sequence_parallel times its share.
DeepSpeed then sums the group's gradients (ZeRO divides by the data parallel size, not
the world). Measured on CPU: step 2 onwards diverged from one process, with grad_norm
exactly 2x under sequence_parallel 2 (tests/test_sequence_parallel.py). Here the
gradient, not the loss, is divided by sequence_parallel: the logged loss stays the
Trainer's, and an unclipped SGD run matches one process."""

from __future__ import annotations

from transformers import TrainerCallback
from trl import SFTTrainer


def gradient_scaled(loss, factor: float):
    """The same value, with a gradient `factor` times the loss's."""
    return loss * factor + (loss * (1 - factor)).detach()


class UlyssesEpochs(TrainerCallback):
    """Keeps the Trainer's epochs and DeepSpeed's UlyssesSPDataLoaderAdapter (which the
    Trainer iterates under Ulysses) in step, and resumes mid-epoch; measured on CPU
    (tests/test_sequence_parallel.py):
    - the adapter ends an epoch only when asked for one batch more, so each later epoch
      of the Trainer's began with an empty step and trained one step fewer (and ended
      before max_steps): drained here at each epoch's end, and the epoch ended there;
    - transformers' resume skips the trained batches with accelerate's
      skip_first_batches, which stops on the adapter ("'UlyssesSPDataLoaderAdapter'
      object has no attribute 'dataset'"): finetune turns the Trainer's skip off
      (ignore_data_skip) and draws the trained batches here, before training begins;
    - the adapter has no set_epoch, so the Trainer's call is skipped and the loader it
      wraps (its `dl`) counts epochs from 0: set to the checkpoint's epoch here."""

    def __init__(self, skip: bool):
        self.skip = skip  # false when the experiment itself sets ignore_data_skip

    @staticmethod
    def _steps(args, loader) -> int:
        return -(-len(loader) // args.gradient_accumulation_steps)  # as the Trainer counts

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        inner = getattr(train_dataloader, "dl", None)
        if inner is None or not state.global_step:
            return
        epoch, done = divmod(state.global_step, self._steps(args, train_dataloader))
        inner.set_epoch(epoch)
        if self.skip:
            for _ in range(done * args.gradient_accumulation_steps):
                next(train_dataloader)

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        if train_dataloader is not None and \
                state.global_step % self._steps(args, train_dataloader) == 0:
            control.should_epoch_stop = True

    def on_epoch_end(self, args, state, control, train_dataloader=None, **kwargs):
        if train_dataloader is None or state.global_step % self._steps(args, train_dataloader):
            return
        try:
            next(train_dataloader)  # the adapter's end of the epoch: it starts the next
        except StopIteration:
            return
        raise RuntimeError("sequence parallelism: the data loader had batches left at the end "
                           "of an epoch")


class SequenceParallelSFTTrainer(SFTTrainer):
    def __init__(self, *args, ignores_data_skip: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(UlyssesEpochs(skip=not ignores_data_skip))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        config = self.accelerator.parallelism_config
        if not self.model.training or config is None or config.sp_size == 1:
            return out
        if return_outputs:
            return gradient_scaled(out[0], 1 / config.sp_size), out[1]
        return gradient_scaled(out, 1 / config.sp_size)
