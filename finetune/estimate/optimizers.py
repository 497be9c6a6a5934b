"""Optimizer state bytes per trainable tensor, by the Trainer's `optim` name.

torch optimizers keep their states in the parameter's dtype, plus a 4-byte fp32 `step`
tensor per parameter (AdamW, Adagrad, RMSprop). bitsandbytes 8-bit optimizers quantize a
state to 1 byte per element with one fp32 absmax per 256-element block, but only for
tensors of at least 4096 elements (min_8bit_size); smaller ones get fp32 states, as do
bitsandbytes' 32-bit optimizers whatever the parameter dtype; bitsandbytes keeps `step`
as a Python int.
"""

from __future__ import annotations

from dataclasses import dataclass

BNB_BLOCK = 256
BNB_MIN_8BIT = 4096


@dataclass(frozen=True)
class OptimizerModel:
    kind: str          # torch, bnb8, bnb32, factored, none
    states: int        # state tensors per parameter
    note: str = ""


_TORCH_ADAM = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused",
               "adamw_anyprecision", "stable_adamw")
MODELS: dict[str, OptimizerModel] = {
    **{name: OptimizerModel("torch", 2) for name in _TORCH_ADAM},
    "adagrad": OptimizerModel("torch", 1),
    "rmsprop": OptimizerModel("torch", 1),
    "sgd": OptimizerModel("none", 0, "sgd: the Trainer builds torch SGD without momentum, "
                                     "which keeps no state"),
    "lomo": OptimizerModel("none", 0, "lomo: fused update, no optimizer state"),
    "adamw_bnb_8bit": OptimizerModel("bnb8", 2),
    "adamw_8bit": OptimizerModel("bnb8", 2),
    "paged_adamw_8bit": OptimizerModel("bnb8", 2, "paged: states may page out to CPU memory "
                                                  "under pressure; counted on the GPU"),
    "paged_adamw_32bit": OptimizerModel("bnb32", 2, "paged: counted on the GPU"),
    "lion_8bit": OptimizerModel("bnb8", 1),
    "paged_lion_8bit": OptimizerModel("bnb8", 1),
    "lion_32bit": OptimizerModel("bnb32", 1),
    "paged_lion_32bit": OptimizerModel("bnb32", 1),
    "ademamix": OptimizerModel("bnb32", 3),
    "paged_ademamix_32bit": OptimizerModel("bnb32", 3),
    "ademamix_8bit": OptimizerModel("bnb8", 3),
    "paged_ademamix_8bit": OptimizerModel("bnb8", 3),
    "rmsprop_bnb": OptimizerModel("bnb32", 1),
    "rmsprop_bnb_32bit": OptimizerModel("bnb32", 1),
    "rmsprop_bnb_8bit": OptimizerModel("bnb8", 1),
    "adafactor": OptimizerModel("factored", 0, "adafactor: factored second moments "
                                               "(rows + columns) in fp32, no first moment"),
    "adalomo": OptimizerModel("factored", 0, "adalomo: factored second moments"),
    "adamw_torch_8bit": OptimizerModel("bnb8", 2, "adamw_torch_8bit (torchao): modelled as "
                                                  "1 byte per state with fp32 block scales"),
    "adamw_torch_4bit": OptimizerModel("bnb8", 1, "adamw_torch_4bit (torchao): modelled as "
                                                  "two 4-bit states with fp32 block scales"),
    "schedule_free_adamw": OptimizerModel("torch", 2),
    "schedule_free_radam": OptimizerModel("torch", 2),
    "schedule_free_sgd": OptimizerModel("torch", 1),
    "grokadamw": OptimizerModel("torch", 3),
}


def model_of(optim: str) -> tuple[OptimizerModel, str | None]:
    """The model for `optim`, and a note when it had to be assumed."""
    if optim in MODELS:
        found = MODELS[optim]
        return found, found.note or None
    return MODELS["adamw_torch"], (f"optim {optim!r} (low-rank or other) is not modelled: its "
                                   "states are counted as AdamW's, an upper bound")


def state_bytes(optim: str, numel: int, elt: int, shape2d: tuple[int, int] | None = None) -> int:
    """Bytes of the optimizer state of one tensor of `numel` elements of `elt` bytes."""
    model, _ = model_of(optim)
    if model.kind == "torch":
        return model.states * numel * elt + 4  # + the fp32 `step` tensor
    if model.kind == "bnb32" or (model.kind == "bnb8" and numel < BNB_MIN_8BIT):
        return model.states * numel * 4
    if model.kind == "bnb8":
        blocks = -(-numel // BNB_BLOCK)
        return model.states * (numel + 4 * blocks)
    if model.kind == "factored":
        if shape2d:
            return 4 * (shape2d[0] + shape2d[1])
        return 4 * numel
    return 0
