"""The estimate as a table for people, or as JSON for programs."""

from __future__ import annotations

import re
from typing import Any

from finetune.estimate import moe
from finetune.estimate.api import Estimate
from finetune.estimate.core import FRAGMENTATION, GiB, Evaluation

_UNITS = {"": GiB, "g": GiB, "gb": GiB, "gib": GiB, "m": 1024 ** 2, "mb": 1024 ** 2,
          "mib": 1024 ** 2, "t": 1024 ** 4, "tb": 1024 ** 4, "tib": 1024 ** 4}


MAX_MEMORY = 2**50  # bytes (1 PiB)


def parse_memory(text: str) -> int:
    """'80GB', '80GiB', '24G', '80' (GB) -> bytes. GB means 2^30 bytes here, as in GPU
    names: an "80GB" H100 has 80 GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"cannot read {text!r} as a memory size; use e.g. 80GB, 80GiB, 24G "
                         "or a plain number of GB")
    size = float(match.group(1)) * _UNITS[unit]
    if size > MAX_MEMORY:
        raise ValueError(f"{text!r} is more than {MAX_MEMORY // 2**40:,} TiB, past any device")
    return int(size)


MAX_IMAGE_SIDE = 2**16  # pixels: far past any picture a processor takes


def parse_image_size(text: str) -> tuple[int, int]:
    """'640x480' (width x height) or '448' (a square) -> (width, height) in pixels."""
    match = re.fullmatch(r"\s*([0-9]+)\s*(?:[xX]\s*([0-9]+))?\s*", text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as an image size; use WIDTHxHEIGHT in "
                         "pixels (640x480) or one number for a square")
    width = int(match.group(1))
    height = int(match.group(2) or width)
    if not (0 < width <= MAX_IMAGE_SIDE and 0 < height <= MAX_IMAGE_SIDE):
        raise ValueError(f"{text!r}: each side must be 1..{MAX_IMAGE_SIDE:,} pixels")
    return width, height


def human(n: int | float) -> str:
    """GiB for big numbers, MiB or KiB below one GiB, so small models do not read 0.00."""
    for unit, size in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= 1000 * size / 1024 or unit == "KiB":
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _params(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 10 ** 8 else f"{n:,}"


def _rows(ev: Evaluation) -> list[tuple[str, int]]:
    rows = [(label, value) for key, label, value in ev.rows if value]
    tensors = ev.fixed + ev.micro_batch * ev.per_sample
    rows.append((f"allocator fragmentation ({FRAGMENTATION:.0%})", int(tensors * FRAGMENTATION)))
    if ev.overhead:
        rows.append(("CUDA context and workspaces (constant)", ev.overhead))
    return rows


def render_text(est: Estimate) -> str:
    s, shape, ev = est.settings, est.shape, est.configured
    unit, plural = ("GPU", "GPUs") if s.device == "cuda" else ("process", "processes")
    peft = s.peft.type if s.peft.type == "none" else (
        f"{s.peft.type} r={s.peft.r}" + (f" {s.peft.bits}-bit" if s.peft.type == "qlora" else ""))
    lines = [
        f"model: {shape.model_type}, {_params(est.params)} parameters ({shape.source})",
        *([f"  language model {_params(est.parts['language_model'])}, vision tower "
           f"{_params(est.parts['vision_tower'])}, projector {_params(est.parts['projector'])}; "
           f"{shape.image_tokens} tokens an image, {s.images_per_row} image"
           f"{'s' if s.images_per_row != 1 else ''} per row (assumed)"]
          if est.parts else []),
        f"training: {s.method}, {'full fine-tuning' if s.peft.type == 'none' else peft}, "
        f"{est.trainable_params:,} trainable, {s.precision}, optim {s.optim}",
        f"batch: micro batch {s.micro_batch} x {s.seq_len} tokens"
        + (f" x {s.sequences} sequences" if s.sequences > 1 else "")
        + f", activation checkpointing {'on' if s.checkpointing else 'off'}",
        f"layout: {ev.layout.label()}, {s.world} {plural if s.world > 1 else unit}",
        "",
        f"per {unit}:",
    ]
    rows = _rows(ev)
    width = max(len(label) for label, _ in rows)
    lines += [f"  {label:<{width}}  {human(value):>14}" for label, value in rows]
    lines.append(f"  {'total':<{width}}  {human(ev.total):>14}")
    if ev.states.cpu:
        lines.append(f"  host memory (offload): {human(ev.states.cpu)} per process, "
                     f"{human(ev.states.cpu * s.per_machine)} per machine")
    verdict = "fits" if ev.fits else "does NOT fit"
    lines += ["", f"against {human(est.gpu_memory)} per {unit}: {verdict}; largest micro batch "
                  f"with this layout: {ev.max_micro_batch}", "",
              f"ladder (cheapest first, micro batch {s.micro_batch}):"]
    width = max(len(option.layout.label()) for option in est.ladder)
    for option in est.ladder:
        mark = "fits" if option.fits else "    "
        lines.append(f"  {mark}  {option.layout.label():<{width}}  {human(option.total):>14}  "
                     f"max micro batch {option.max_micro_batch}")
    lines += ["", "recommendation:"] + [f"  {line}" for line in est.recommendation]
    lines += ["", "assumed:"] + [f"  - {line}" for line in _assumed(est)]
    lines += ["not counted:"] + [f"  - {line}" for line in est.not_counted]
    return "\n".join(lines) + "\n"


def _assumed(est: Estimate) -> list[str]:
    """What the estimate assumed, with a mixture of experts' routing and kernel."""
    return est.assumptions + ([moe.note(est.shape)] if est.shape.moe else [])


def _evaluation(ev: Evaluation) -> dict[str, Any]:
    return {"layout": ev.layout.label(), "micro_batch": ev.micro_batch,
            "activation_checkpointing": ev.checkpointing,
            "bytes": {key: value for key, _, value in ev.rows},
            "fragmentation_bytes": int((ev.fixed + ev.micro_batch * ev.per_sample) * FRAGMENTATION),
            "cuda_context_bytes": ev.overhead, "total_bytes": ev.total,
            "host_bytes_per_process": ev.states.cpu, "fits": ev.fits,
            "max_micro_batch": ev.max_micro_batch}


def as_dict(est: Estimate) -> dict[str, Any]:
    s, shape = est.settings, est.shape
    return {
        "model": {"model_type": shape.model_type, "config": shape.source, "params": est.params,
                  "trainable_params": est.trainable_params, "layers": shape.layers,
                  "hidden_size": shape.hidden, "vocab_size": shape.vocab,
                  **({"parts": est.parts, "image_tokens": shape.image_tokens}
                     if est.parts else {})},
        "settings": {"method": s.method, "peft": s.peft.type, "precision": s.precision,
                     "optim": s.optim, "micro_batch": s.micro_batch, "seq_len": s.seq_len,
                     "sequences_per_sample": s.sequences,
                     "activation_checkpointing": s.checkpointing, "gpus": s.world,
                     "gpus_per_machine": s.per_machine, "device": s.device,
                     **({"images_per_row": s.images_per_row,
                         "vision_trains": {"tower": s.vision_training.tower,
                                           "projector": s.vision_training.projector}}
                        if est.parts else {}),
                     # the picture's size, where the tokens depend on it (Qwen, tiles)
                     **({"image_size": list(shape.vision.image)}
                        if est.parts and hasattr(shape.vision, "image") else {})},
        "gpu_memory_bytes": est.gpu_memory,
        "configured": _evaluation(est.configured),
        "ladder": [_evaluation(ev) for ev in est.ladder],
        "recommendation": est.recommendation,
        "assumptions": _assumed(est),
        "not_counted": est.not_counted,
    }
