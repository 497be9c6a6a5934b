#!/usr/bin/env python
"""The same SFT run written against plain TRL (trl.SFTTrainer + SFTConfig). It measures
itself as finetune does, through public API only: a callback of its own appends every log
event to <output-dir>/metrics.jsonl (step, time.time() at on_log, the logs: TRL's
num_tokens, the Trainer's num_input_tokens_seen), and the effective TrainingArguments go
to <output-dir>/training_args.json. bench/meter.py reads both the same way for every
contender; at the end the window is printed as one JSON line.

Modes:
  defaults  TRL's defaults; only the shared settings are given (batch size, learning
            rate, steps, max_length, precision, device, seed, logging steps, and the logging
            option include_num_input_tokens_seen="all", which every contender gets, finetune
            included: it only adds a count to the logs). The model is fp32 (TRL's own
            default dtype when it loads a model), LoRA through peft_config.
  tuned     defaults + packing=True, TRL's default packing strategy (bfd): sequences are
            packed best-fit into max_length rows and flattened into padding-free batches
            with position_ids.
  same      finetune's effective settings: the SFTConfig is rebuilt from the
            training_args.json of a finetune run (--finetune-args), and the model is built
            as finetune builds it (fp32 weights for full fine-tuning; under LoRA the frozen
            base in the compute dtype and the adapters applied before the trainer).

Usage: python bench/plain_trl.py --model DIR --tokenizer DIR --data rows.jsonl
           [--mode defaults|tuned|same] [--finetune-args training_args.json] [--lora] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

# finetune's LoRA defaults (finetune/config/schema.py PeftSection), used by every contender.
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (config.json, weights)")
    p.add_argument("--init", choices=["random", "pretrained"], default="random")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True, help="JSONL of `messages` rows")
    p.add_argument("--mode", choices=["defaults", "tuned", "same"], default="defaults")
    p.add_argument("--finetune-args", help="mode same: a finetune run's training_args.json")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--attn", help="attn_implementation (default: transformers' choice, sdpa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--output-dir", help="the Trainer's output_dir and where metrics.jsonl "
                   "goes (default: a temp dir)")
    return p.parse_args(argv)


def sft_config(args: argparse.Namespace, output_dir: str):
    from trl import SFTConfig

    if args.mode == "same":
        # finetune's effective TrainingArguments, as it wrote them; only where to write
        # changes. to_dict() masks *_token fields ("<HUB_TOKEN>"): those keep defaults.
        saved = json.loads(Path(args.finetune_args).read_text())
        fields = {f.name for f in dataclasses.fields(SFTConfig) if f.init}
        kwargs = {k: v for k, v in saved.items() if k in fields
                  and not (k.endswith("_token") and v == f"<{k.upper()}>")}
        kwargs["output_dir"] = output_dir
        # finetune tokenizes (and packs) the rows itself and tells SFTTrainer to skip its
        # own preparation; plain TRL gets the raw rows, so TRL prepares them.
        dataset_kwargs = dict(kwargs.get("dataset_kwargs") or {})
        dataset_kwargs.pop("skip_prepare_dataset", None)
        kwargs["dataset_kwargs"] = dataset_kwargs or None
        if kwargs.get("padding_free") and not kwargs.get("packing"):
            # SFTTrainer refuses padding_free with a max_length it cannot enforce; finetune
            # truncates while tokenizing. bench rows are generated within max_length
            # (make_data clips them), so "already truncated inputs", as TRL asks, holds.
            kwargs["max_length"] = None
        return SFTConfig(**kwargs)
    shared = dict(output_dir=output_dir, per_device_train_batch_size=args.batch_size,
                  learning_rate=args.lr, max_steps=args.steps, max_length=args.max_length,
                  bf16=args.precision == "bf16", fp16=False, use_cpu=args.device == "cpu",
                  seed=args.seed, logging_steps=args.logging_steps, report_to="none",
                  save_strategy="no",  # housekeeping after the timed window; all skip it
                  # batch positions (padding included) in every log, for the padding share
                  include_num_input_tokens_seen="all")
    if args.mode == "tuned":
        shared["packing"] = True  # packing_strategy stays TRL's default, "bfd"
    return SFTConfig(**shared)


def build_model(args: argparse.Namespace, config_args, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    compute = torch.bfloat16 if config_args.bf16 else torch.float32
    # TRL loads models in fp32 by default; finetune keeps a LoRA run's frozen base in the
    # compute dtype (finetune/model/load.py _load_dtype).
    dtype = compute if (args.mode == "same" and args.lora) else torch.float32
    config = AutoConfig.from_pretrained(args.model)
    config.pad_token_id = tokenizer.pad_token_id
    attn = {"attn_implementation": args.attn} if args.attn else {}
    if args.attn == "finetune_varlen":  # finetune's own function (mode same, on a GPU)
        from finetune.model import varlen

        varlen.register()
    set_seed(config_args.seed)
    if args.init == "random":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=dtype,
                                                     **attn)
    peft_config = None
    if args.lora:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(task_type="CAUSAL_LM", **LORA)
        if args.mode == "same":  # finetune applies the adapters itself
            model, peft_config = get_peft_model(model, peft_config), None
    return model, peft_config


def log_file(path: Path):
    """A TrainerCallback appending every log event to `path` as finetune's metrics.jsonl
    does: step, time.time() at on_log (ms), the logs."""
    from transformers import TrainerCallback

    class LogFile(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
                with path.open("a") as handle:
                    handle.write(json.dumps(record, default=str) + "\n")

    return LogFile()


def run(args: argparse.Namespace) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    import meter

    output_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="plain-trl-"))
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics = output_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    config_args = sft_config(args, str(output_dir))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dataset = load_dataset("json", data_files=args.data, split="train")
    model, peft_config = build_model(args, config_args, tokenizer)
    trainer = SFTTrainer(model=model, args=config_args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config,
                         callbacks=[log_file(metrics)])
    # What it runs with: TRL turns padding-free on itself for packing with bfd.
    saved = {**trainer.args.to_dict(), "padding_free": getattr(trainer, "padding_free",
                                                          trainer.args.padding_free)}
    (output_dir / "training_args.json").write_text(json.dumps(saved, indent=1) + "\n")
    trainer.train()
    result = meter.window(metrics, args.warmup_steps)
    result.update(contender=f"plain TRL ({args.mode})", mode=args.mode, lora=args.lora,
                  output_dir=str(output_dir))
    return result


def main(argv=None) -> None:
    args = parse(argv)
    if args.mode == "same" and not args.finetune_args:
        sys.exit("--mode same needs --finetune-args (a finetune run's training_args.json)")
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
