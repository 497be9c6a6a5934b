"""SFT under sequence parallelism (DeepSpeed ALST/Ulysses) with the gradient one process
computes.

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

from trl import SFTTrainer


def gradient_scaled(loss, factor: float):
    """The same value, with a gradient `factor` times the loss's."""
    return loss * factor + (loss * (1 - factor)).detach()


class SequenceParallelSFTTrainer(SFTTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        config = self.accelerator.parallelism_config
        if not self.model.training or config is None or config.sp_size == 1:
            return out
        if return_outputs:
            return gradient_scaled(out[0], 1 / config.sp_size), out[1]
        return gradient_scaled(out, 1 / config.sp_size)
