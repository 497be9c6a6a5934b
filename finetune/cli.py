"""The `finetune` command. Each subcommand imports what it needs when it runs, so
`--help` and `validate` never pay for torch or transformers."""

from __future__ import annotations

import argparse
import gc
import sys

from finetune import __version__
from finetune.commands.args import EXIT_USER_ERROR, Parser, checked, time_limit, whole
# torch-free, no finetune imports
from finetune.config.script_values import (MAX_LENGTH, MAX_MACHINES, MAX_PROCESSES,
                                    MAX_PROCESSES_PER_MACHINE, MAX_SIGNAL_SECONDS)
from finetune.run.noise import hide_known_noise  # torch-free: logging filters


def _add_experiment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a setting, typed as the schema says "
                             "(e.g. training.learning_rate=1e-4 peft.r=32)")


def _validate(args: argparse.Namespace) -> int:
    from finetune.config import load_experiment
    from finetune.data.scan import check_data
    from finetune.render.bundle import resolved_yaml

    experiment = load_experiment(args.config, args.overrides)
    read = [] if args.no_data else check_data(experiment)
    if args.print:
        sys.stdout.write(resolved_yaml(experiment))
    else:
        print("\n".join(read + [""]), end="")
        print(f"{args.config}: ok ({experiment.method}, model {experiment.model.name_or_path}, "
              f"peft {experiment.peft.type})")
    return 0


def _train(args: argparse.Namespace) -> int:
    import os
    import time

    launched = time.time()  # before the heavy imports: see data/prepare.py, _wait

    from finetune.errors import ConfigError, DataError, RunError, exit_code
    from finetune.run.launched import (early_launch_problems, experiment_as_launched, rank_of,
                                       record_failure)
    from finetune.render.bundle import prepare_run_dir

    experiment = experiment_as_launched(args.config, args.overrides, os.environ)
    problems = early_launch_problems(experiment, os.environ)
    if problems:
        raise RunError("; ".join(problems))
    experiment, run_dir, plan = prepare_run_dir(experiment, rank=rank_of(os.environ))

    hide_known_noise(experiment.peft.type == "qlora")  # main() hid it for the rest
    from finetune.run.preemption import Preempted  # heavy from here: torch, transformers, trl
    from finetune.run.worker import train

    try:
        train(experiment, run_dir, plan, launched)
    except (ConfigError, DataError, RunError) as exc:
        record_failure(run_dir, exc)
        raise
    except Preempted as stopped:
        code = exit_code(stopped.signal_name)
        print(f"finetune: {stopped}; exit {code}. Run the same command again to continue "
              "from it.", file=sys.stderr, flush=True)
        return code
    return 0


def _launch_overrides(args: argparse.Namespace) -> list[str]:
    """Launch flags are sugar for distributed.* overrides. Strings are written as JSON
    strings (YAML reads them back as text: a host named `yes` or `1e5` stays one)."""
    import json

    flags = {"num_processes": args.num_processes, "num_machines": args.num_machines,
             "main_process_ip": args.main_process_ip,
             "main_process_port": args.main_process_port, "launcher": args.launcher}
    return [f"distributed.{key}={json.dumps(value)}" for key, value in flags.items()
            if value is not None]


def _load_here(config: str, overrides: list[str]):
    """The experiment as this machine runs it: `distributed.device: auto` resolved here
    (launch/probe.py), said in one line before any error that follows from it."""
    from finetune.config import load_experiment
    from finetune.launch.probe import resolved_overrides

    experiment = load_experiment(config, overrides)
    extra, note = resolved_overrides(experiment.distributed.device)
    if not extra:
        return experiment
    print(note, flush=True)
    return load_experiment(config, [*overrides, *extra])


def _render(args: argparse.Namespace) -> int:
    from pathlib import Path

    from finetune.render.bundle import write_bundle
    from finetune.rundir.paths import run_dir_of

    experiment = _load_here(args.config, args.overrides)
    out = Path(args.out) if args.out else run_dir_of(experiment)
    for path in write_bundle(experiment, out.absolute()):
        print(path)
    return 0


def _launch(args: argparse.Namespace) -> int:
    import os
    import shlex

    from finetune.rundir import checkpoints
    from finetune.errors import RunError
    from finetune.launch.rendezvous import wait_for_main
    from finetune.render.scripts import launch_argv
    from finetune.launch.threads import launcher_threads
    from finetune.run.launched import parallel_note
    from finetune.launch.forward import run_forwarding
    from finetune.render.bundle import prepare_run_dir

    overrides = [*args.overrides, *_launch_overrides(args)]
    experiment = _load_here(args.config, overrides)
    machines = experiment.distributed.num_machines
    if args.machine_rank >= machines:
        raise RunError(f"--machine-rank {args.machine_rank}: the experiment has {machines} "
                       f"machine(s) (distributed.num_machines), so ranks 0..{machines - 1}")
    threads, threads_note = launcher_threads(experiment, os.environ)
    for note in (parallel_note(experiment, experiment.distributed.device), threads_note):
        if note:
            print(f"finetune: {note}", flush=True)
    # Decides (and refuses) a resume before anything starts; rank 0 of the run reports it.
    experiment, run_dir, _ = prepare_run_dir(experiment)
    argv = launch_argv(experiment, run_dir, args.machine_rank)
    print(f"finetune: bundle in {run_dir}; machine {args.machine_rank} runs:\n  "
          f"{shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    dist = experiment.distributed
    if args.machine_rank > 0 and not wait_for_main(dist.main_process_ip, dist.main_process_port,
                                                   dist.rdzv_timeout):
        raise RunError(f"machine {args.machine_rank} cannot reach the main process at "
                       f"{dist.main_process_ip}:{dist.main_process_port} within "
                       f"{dist.rdzv_timeout} s (distributed.rdzv_timeout): is machine 0 "
                       "started, and is that address and port reachable from here?")
    return run_forwarding(argv, run_dir / checkpoints.STOPPED, run_dir, threads)


def _slurm(args: argparse.Namespace) -> int:
    import subprocess

    from finetune.config import load_experiment
    from finetune.errors import RunError
    from finetune.render.scripts import sbatch_script
    from finetune.config.script_values import time_seconds
    from finetune.render.bundle import prepare_run_dir, write_file

    if args.signal_seconds >= time_seconds(args.time):  # both checked by argparse
        raise RunError(f"--signal-seconds {args.signal_seconds} is not before the time limit "
                       f"{args.time}")
    # distributed.device auto stays auto: this is a login node; `finetune launch` resolves
    # it on each compute node (launch/probe.py).
    per_node = max(args.gpus_per_node, 1)
    overrides = [*args.overrides, f"distributed.num_machines={args.nodes}",
                 f"distributed.processes_per_machine={per_node}",
                 f"distributed.num_processes={args.nodes * per_node}"]
    if args.gpus_per_node == 0:
        overrides.append("distributed.device=cpu")
    experiment, run_dir, _ = prepare_run_dir(load_experiment(args.config, overrides))
    script = run_dir / "job.sbatch"
    write_file(script, sbatch_script(experiment, run_dir, nodes=args.nodes,
                                     gpus_per_node=args.gpus_per_node, time=args.time,
                                     partition=args.partition,
                                     signal_seconds=args.signal_seconds))
    print(f"finetune: wrote {script}")
    if not args.submit:
        return 0
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RunError(f"sbatch failed: {result.stderr.strip()}")
    print(f"finetune: submitted job {result.stdout.strip()}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import json

    from finetune.config import load_experiment
    from finetune.errors import ConfigError
    from finetune.estimate import (as_dict, estimate, parse_image_size, parse_memory,
                                   render_text)

    try:
        memory = parse_memory(args.gpu_memory)
    except ValueError as exc:
        raise ConfigError([f"--gpu-memory: {exc}"]) from None
    try:
        image = parse_image_size(args.image_size) if args.image_size else None
    except ValueError as exc:
        raise ConfigError([f"--image-size: {exc}"]) from None
    experiment = load_experiment(args.config, args.overrides)
    result = estimate(experiment, gpus=args.gpus, gpu_memory=memory, seq_len=args.seq_len,
                      images_per_row=args.images_per_row, image_size=image)
    if args.json:
        print(json.dumps(as_dict(result), indent=1))
    else:
        sys.stdout.write(render_text(result))
    return 0


def _reference(args: argparse.Namespace) -> int:
    from finetune.config.reference import markdown

    sys.stdout.write(markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="finetune",
        description="Fine-tune language models from a declarative YAML experiment.")
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=Parser)

    validate = commands.add_parser(
        "validate", help="check an experiment without loading anything heavy",
        description="Check an experiment: schema, training fields, files, cross-field rules, "
                    "and every row of its local data files as training checks them. "
                    "Exit 0 if valid, 2 with one line per problem otherwise.")
    _add_experiment_args(validate)
    validate.add_argument("--no-data", action="store_true",
                          help="do not read the data files (only that they exist)")
    validate.add_argument("--print", action="store_true",
                          help="print the resolved experiment with every default filled")
    validate.set_defaults(func=_validate)

    train = commands.add_parser(
        "train", help="train in this process",
        description="Validate the experiment, write the run directory and train in this "
                    "process (CPU or one GPU).")
    _add_experiment_args(train)
    train.set_defaults(func=_train)

    render = commands.add_parser(
        "render", help="write the run bundle (accelerate.yaml, deepspeed.json, launch.sh)",
        description="Write the resolved experiment, the Accelerate config, the DeepSpeed "
                    "config (strategy deepspeed) and launch.sh, without starting anything.")
    _add_experiment_args(render)
    render.add_argument("--out", help="directory to write to (default: the run directory)")
    render.set_defaults(func=_render)

    launch = commands.add_parser(
        "launch", help="start the run's processes on this machine",
        description="Write the run bundle and start this machine's processes with "
                    "accelerate launch (default) or torchrun. Each process runs `finetune "
                    "train` and checks its world size, rank and backend before training.")
    _add_experiment_args(launch)
    launch.add_argument("--num-processes", type=whole(1, MAX_PROCESSES),
                        help="processes in total (distributed.num_processes); without a "
                             "strategy they train as DDP")
    launch.add_argument("--num-machines", type=whole(1, MAX_MACHINES),
                        help="distributed.num_machines")
    launch.add_argument("--machine-rank", type=whole(0, MAX_MACHINES - 1), default=0,
                        help="this machine's rank, 0..num_machines-1")
    launch.add_argument("--main-process-ip", type=checked("host_problem"),
                        help="distributed.main_process_ip")
    launch.add_argument("--main-process-port", type=whole(1, 65535),
                        help="distributed.main_process_port")
    launch.add_argument("--launcher", choices=["accelerate", "torchrun"],
                        help="distributed.launcher")
    launch.add_argument("--dry-run", action="store_true",
                        help="write the bundle and print the command, start nothing")
    launch.set_defaults(func=_launch)

    slurm = commands.add_parser(
        "slurm", help="write (and submit) a SLURM batch script for the run",
        description="Write job.sbatch into the run directory: one srun task per node, each "
                    "running `finetune launch` with its SLURM_NODEID as machine rank; "
                    "--requeue, and USR1 before the time limit, forwarded to the trainers.")
    _add_experiment_args(slurm)
    slurm.add_argument("--nodes", type=whole(1, MAX_MACHINES), required=True,
                       help="nodes (machines)")
    slurm.add_argument("--gpus-per-node", type=whole(0, MAX_PROCESSES_PER_MACHINE), default=0,
                       help="GPUs (and processes) per node; 0 trains one process per node "
                            "on the CPU")
    slurm.add_argument("--time", type=time_limit, required=True,
                       help="time limit, as SLURM takes it: MM, MM:SS, HH:MM:SS, D-HH, "
                            "D-HH:MM or D-HH:MM:SS")
    slurm.add_argument("--partition", type=checked("partition_problem"),
                       help="SLURM partition (or several, comma-separated)")
    slurm.add_argument("--signal-seconds", type=whole(0, MAX_SIGNAL_SECONDS), default=120,
                       help="send USR1 this many seconds before the time limit")
    slurm.add_argument("--submit", action="store_true", help="submit with sbatch")
    slurm.set_defaults(func=_slurm)

    estimate = commands.add_parser(
        "estimate", help="estimate per-GPU memory and recommend a layout (no torch)",
        description="Estimate per-GPU memory of the experiment (weights, gradients, "
                    "optimizer states, activations) from the model's config.json, and "
                    "recommend the cheapest layout (data parallel, ZeRO-1/2/3, offload) and "
                    "the largest micro batch that fit. See docs/estimate.md.")
    _add_experiment_args(estimate)
    estimate.add_argument("--gpus", type=whole(1, MAX_PROCESSES),
                          help="number of GPUs (default: the experiment's world size)")
    estimate.add_argument("--gpu-memory", default="80GB",
                          help="memory per GPU: 80GB, 80GiB, 24G or a number of GB "
                               "(GB = 2^30 bytes; default 80GB)")
    estimate.add_argument("--seq-len", type=whole(1, MAX_LENGTH),
                          help="tokens per sequence (default: training.max_length, "
                               "classify.max_length, or 512 prompt + completion tokens)")
    estimate.add_argument("--images-per-row", type=whole(0, MAX_LENGTH),
                          help="a vision-language model's images in each row (default 1)")
    estimate.add_argument("--image-size",
                          help="a vision-language model's pictures, WIDTHxHEIGHT pixels "
                               "before the processor resizes them, where the tokens depend "
                               "on it (Qwen2-VL; default 640x480)")
    estimate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    estimate.set_defaults(func=_estimate)

    reference = commands.add_parser(
        "reference", help="print every method and experiment key (type, default, meaning)",
        description="Print the experiment reference (Markdown): methods and keys, generated.")
    reference.set_defaults(func=_reference)

    # Commands whose parsers live beside their code (each torch-free at import).
    from finetune.commands import data, eval as evaluation, machine
    from finetune.hub import upload
    from finetune.inference import cli as inference
    from finetune.report import plots
    from finetune.sweep import cli as sweep

    # eval; merge, generate, chat; plot; push; data; sweep; env
    for module in (evaluation, inference, plots, upload, data, sweep, machine):
        module.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from finetune.errors import ConfigError, DataError, RunError, RunFinished

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow the flags too: `finetune launch exp.yaml --dry-run a.b=1`.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    hide_known_noise()
    try:
        return args.func(args)
    except RunFinished as done:  # a requeued job of a finished run succeeds
        print(f"finetune: {done}", flush=True)
        return 0
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (DataError, RunError) as exc:
        for line in str(exc).splitlines() or [""]:  # every line says it is an error
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ImportError:  # transformers imports a torchvision that is there, broken or not
        from finetune.commands.machine import torchvision_problem

        problem = torchvision_problem()
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR


def entry() -> None:
    """`finetune` and `python -m finetune` (every launched rank too): main, then out.
    torch, transformers and TRL leave millions of objects, which the interpreter's last
    garbage collection walks on the way out (~1.5 s a process); frozen, that collection
    skips them (the operating system frees them with the process). atexit handlers,
    trackers' included, still run."""
    code = main()
    gc.freeze()
    raise SystemExit(code)
