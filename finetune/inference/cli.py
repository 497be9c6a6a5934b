"""The subcommands that use a run's model: merge, generate, chat. Their parsers are built
here (torch-free); each handler imports the torch side when it runs."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from finetune.commands.args import whole

MODEL_HELP = ("which model of the run: a checkpoint (checkpoint-200, or its path), or "
              "another model directory such as merged (default: final/)")


def _shard_size(text: str) -> str:
    if not re.fullmatch(r"[1-9][0-9]{0,12}[KMG]i?B", text):
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    return text


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) to 100, got {value}")
    return value


def _top_p(text: str) -> float:
    value = _temperature(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _weights(text: str) -> list[float]:
    """--reward-weights 1,0.5: finite numbers, comma-separated."""
    import math

    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") \
            from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"weights must be finite, got {text!r}")
    return values


def _sampling_args(parser: argparse.ArgumentParser, temperature_help: str =
                   "0 (the default) decodes greedily; above 0 samples") -> None:
    parser.add_argument("--max-new-tokens", type=whole(1, 1_000_000), default=256,
                        help="tokens to generate at most (default 256; never past the "
                             "model's context)")
    parser.add_argument("--temperature", type=_temperature, default=None, help=temperature_help)
    parser.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling (with "
                        "--temperature above 0)")
    parser.add_argument("--seed", type=whole(0, 2**32 - 1), default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto: bf16 (or fp16) on a GPU, fp32 on the CPU")


def _quiet() -> None:
    """Set before the libraries are imported: bitsandbytes warns at import that a faster
    4-bit CPU kernel is not installed, which matters to nothing here."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _merge(args: argparse.Namespace) -> int:
    _quiet()
    from finetune.inference.merge import merge

    target = merge(args.run_dir, out=args.out, checkpoint=args.checkpoint, dtype=args.dtype,
                   max_shard_size=args.max_shard_size, force=args.force)
    print(f"finetune: merged model in {target}")
    return 0


def _output(path: str | None, force: bool):
    """stdout, or a new file (an existing one only with --force): written aside, renamed."""
    from finetune.errors import RunError

    if path is None:
        return None
    target = Path(path)
    if os.path.lexists(target) and (target.is_dir() or not force):
        raise RunError(f"--out {path} exists; nothing was written"
                       + ("" if target.is_dir() else " (--force replaces it)"))
    return target


def _best_of_problems(args: argparse.Namespace) -> list[str]:
    """The flags --best-of needs, or that need it."""
    if args.best_of is None:
        named = [flag for flag, value in (("--reward", args.reward), ("--reward-weights",
                 args.reward_weights), ("--pairs", args.pairs)) if value is not None]
        return [f"{flag}: only with --best-of N" for flag in named]
    problems = []
    if args.temperature == 0:
        problems.append("--temperature 0 with --best-of: greedy decoding gives the same "
                        "completion N times; sample (the default with --best-of is 1.0)")
    if args.reward_weights is not None and not args.reward:
        problems.append("--reward-weights: only with --reward (the run's own rewards: "
                        "section has its weights)")
    return problems


def _generate(args: argparse.Namespace) -> int:
    _quiet()
    from finetune.errors import ConfigError, RunError

    problems = _best_of_problems(args)
    if args.image and not args.prompt:
        problems.append("--image: with --prompt only (a file's rows give their own `images`)")
    if problems:
        raise ConfigError(problems)
    target = _output(args.out, args.force)
    if args.best_of is not None:
        from finetune.inference import reward_sources
        from finetune.model.saved import read_experiment

        sources = reward_sources.from_flags(args.reward, args.reward_weights) if args.reward \
            else reward_sources.from_run(Path(args.run_dir).absolute(),
                                         read_experiment(Path(args.run_dir).absolute()))
    from finetune.inference.prompts import from_file, from_texts

    prompts = from_texts(args.prompt, args.image) if args.prompt else from_file(args.file)
    partial = target.with_name(f".{target.name}.partial") if target else None
    options = dict(model_choice=args.model, max_new_tokens=args.max_new_tokens,
                   top_p=args.top_p, seed=args.seed, raw=args.raw,
                   batch_size=args.batch_size, dtype=args.dtype)
    if args.best_of is None:
        from finetune.inference.generate import generate

        options.update(temperature=args.temperature or 0.0, top_k=args.top_k)
        write = lambda out: generate(args.run_dir, prompts, out, **options)  # noqa: E731
    else:
        from finetune.inference.best_of_n import best_of_n

        options.update(temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k, n=args.best_of, pairs=args.pairs or "best-worst")
        write = lambda out: best_of_n(args.run_dir, prompts, out, sources, **options)  # noqa
    if partial is None:
        write(sys.stdout)
        return 0
    try:
        with partial.open("w", encoding="utf-8") as out:
            write(out)
        partial.replace(target)
    except OSError as exc:
        raise RunError(f"cannot write {exc.filename or target}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return 0


def _chat(args: argparse.Namespace) -> int:
    _quiet()
    from finetune.inference.chat import chat

    return chat(args.run_dir, model_choice=args.model, system=args.system,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature or 0.0,
                top_p=args.top_p, seed=args.seed, dtype=args.dtype, images=args.image)


def add_commands(commands) -> None:
    """Register merge, generate and chat on the CLI's subparsers."""
    merge = commands.add_parser(
        "merge", help="merge a LoRA/QLoRA run's adapter into its base: a full model",
        description="Fold the adapter of a run's final/ (or --checkpoint) into its base (the "
                    "run's init-model/ for a random-init run, else model.name_or_path; a "
                    "QLoRA base unquantized) and write a full model: sharded safetensors, "
                    "config, tokenizer and chat template. Runs on the CPU.")
    merge.add_argument("run_dir", help="the run directory")
    merge.add_argument("--out", help="where to write it (default: RUN_DIR/merged)")
    merge.add_argument("--checkpoint", help="merge this checkpoint (checkpoint-200, or its "
                                            "path) instead of final/")
    merge.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="dtype of the merged weights (default fp32)")
    merge.add_argument("--max-shard-size", type=_shard_size, default="5GB",
                       help="largest safetensors file (default 5GB)")
    merge.add_argument("--force", action="store_true", help="replace a non-empty --out")
    merge.set_defaults(func=_merge)

    generate = commands.add_parser(
        "generate", help="complete prompts with a run's model, as JSONL",
        description="Load a run's causal LM (final/, a checkpoint or a merged model) and "
                    "complete prompts: one JSON object per prompt with prompt, completion "
                    "(and reference, when a row has an answer). Chat prompts go through "
                    "the run's chat template. Greedy unless --temperature > 0.")
    generate.add_argument("run_dir", help="the run directory")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt (repeat for more); a user turn of the chat template "
                             "unless --raw")
    source.add_argument("--file", metavar="PROMPTS.jsonl",
                        help='rows {"prompt": text or messages} or {"messages": [...]}; a '
                             "conversation ending in an assistant turn is prompted up to it, "
                             "and the turn is kept as reference")
    generate.add_argument("--image", action="append", metavar="PATH",
                          help="a picture for every --prompt (repeat for more; a "
                               "vision-language model's run), before the prompt's text")
    generate.add_argument("--raw", action="store_true",
                          help="plain-text prompts as they are, without the chat template")
    generate.add_argument("--model", help=MODEL_HELP)
    generate.add_argument("--out", help="JSONL file to write (default: standard output)")
    generate.add_argument("--force", action="store_true", help="replace an existing --out")
    generate.add_argument("--batch-size", type=whole(1, 4096), default=8,
                          help="prompts generated together (default 8)")
    _sampling_args(generate, "0 decodes greedily (the default; with --best-of, 1.0); above "
                             "0 samples")
    generate.add_argument("--top-k", type=whole(1, 1_000_000), metavar="K",
                          help="sample from the K likeliest tokens only (with --temperature "
                               "above 0; default: the model's generation config)")
    best = generate.add_argument_group(
        "best-of-N", "sample N completions per prompt, score them with a reward and write "
        "the best and the worst as a preference row (prompt, chosen, rejected, chosen_score, "
        "rejected_score, scores) that method dpo and reward train on")
    best.add_argument("--best-of", type=whole(2, 1024), metavar="N",
                      help="completions sampled per prompt")
    best.add_argument("--reward", action="append", metavar="SOURCE",
                      help="a `method: reward` run directory, a reward model directory, or a "
                           "function as module:function or file.py:function (repeat for "
                           "more; at most one model); default: the run's own rewards: "
                           "section (grpo, ppo, rloo)")
    best.add_argument("--reward-weights", type=_weights, metavar="W1,W2",
                      help="one weight per --reward, in their order (default 1 each); the "
                           "score is the weighted sum")
    best.add_argument("--pairs", choices=["best-worst", "all"],
                      help="best-worst (default): one row per prompt, the best against the "
                           "worst; all: the best against each sample scored below it")
    generate.set_defaults(func=_generate)

    chat = commands.add_parser(
        "chat", help="chat with a run's model in the terminal",
        description="A conversation with a run's causal LM through its chat template, "
                    "streamed. /reset starts again, /exit or Ctrl-D ends it.")
    chat.add_argument("run_dir", help="the run directory")
    chat.add_argument("--model", help=MODEL_HELP)
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.add_argument("--image", action="append", metavar="PATH",
                      help="a picture attached to your first message (repeat for more; a "
                           "vision-language model's run); /image PATH attaches one later")
    _sampling_args(chat)
    chat.set_defaults(func=_chat)
