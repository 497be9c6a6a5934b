"""`finetune merge`: a (Q)LoRA run's adapter folded into its base, written as a full model
(sharded safetensors, config, tokenizer and chat template) that loads anywhere without
PEFT.

The merge runs on the CPU: it is a few matrix products per layer, and host memory is
where a model larger than one GPU fits. A QLoRA base is loaded unquantized, in --dtype:
the adapter was trained against the 4-bit (or 8-bit) rounding of those weights, so the
merged model differs from the quantized base plus adapter by that rounding, and equals
the unquantized base plus adapter.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from finetune.errors import RunError
from finetune.model.saved import DTYPES, load_model, load_tokenizer, locate


def _target(run_dir: Path, out: str | None, force: bool) -> Path:
    target = Path(out).absolute() if out else run_dir / "merged"
    if os.path.lexists(target) and not target.is_dir():
        raise RunError(f"--out {target} is a file, not a directory; nothing was written")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise RunError(f"--out {target} is not empty; nothing was written (--force replaces "
                       "it)")
    return target


def merge(run_dir: str, out: str | None = None, checkpoint: str | None = None,
          dtype: str = "fp32", max_shard_size: str = "5GB", force: bool = False) -> Path:
    run = locate(run_dir, checkpoint)
    if run.experiment.peft.type == "none":
        raise RunError(f"{run.run_dir} is a full fine-tuning run (peft.type none): nothing to "
                       f"merge; {run.directory} is already a full model")
    if not run.adapter:
        raise RunError(f"{run.directory} is a full model, not an adapter: nothing to merge")
    target = _target(run.run_dir, out, force)
    tokenizer = load_tokenizer(run)
    model = load_model(run, tokenizer, DTYPES[dtype], "cpu", merge=True)
    # Written aside and renamed: the target appears whole or not at all.
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(str(staging), max_shard_size=max_shard_size)
        tokenizer.save_pretrained(str(staging))
        if target.is_dir():
            shutil.rmtree(target)
        staging.rename(target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise RunError(f"cannot write the merged model ({exc.filename or staging}: "
                       f"{exc.strerror or exc})") from None
    return target
