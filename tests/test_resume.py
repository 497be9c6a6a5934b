"""Exact resume, measured on real runs: interrupted by SIGTERM at a random step (saved on
the signal) and by SIGKILL at a random point (resumed from the last sealed checkpoint),
a run ends with bitwise the same weights and logged losses as one never interrupted
(fp32, CPU, fixed seed, several epochs, a logging window open at the resume). Kill
points are random; their seed is printed."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import time

import pytest

from conftest import DATA, QUICKSTART, TINY_MODEL, run_cli
from finetune.rundir import checkpoints
from resumable import (Run, assert_continues, assert_identical, experiment, final_weights,
                       losses, stopped_by_ctrl_c, stopped_by_sigterm, wait_for_step)
from teachers import tiny_teacher, tiny_vlm_teacher

pytestmark = pytest.mark.slow  # every test trains, stops and resumes runs

STEPS = 40
VLM_STEPS = 24  # 4 epochs of the 24 rows: the tiny VLM's steps cost more than the text model's


# One chain per path a resume restores differently: sft x1 (the Trainer's RNG and state,
# finetune's loss window; stopped by Ctrl-C in a real terminal, a cold process, instead of
# SIGTERM: the other chains' SIGTERM, a person's way), sft x2 (two ranks; every attempt
# cold interpreters, the launched ranks: a resume owes nothing to the warm fork); dpo x1
# (a reference model); kto x1 (a trainer that samples its rows in order, and a reference
# model); distill x1 (finetune's EpochOrder sampler, sampled generations from a restored
# RNG); gkd x1 (Python's restored `random` picks student or data batches). Exhaustive:
# reward x2 (sft x2's path with a score head), orpo x2 and cpo x1 (TRL's experimental
# preference trainers: the Trainer's restore, as sft's), kto x2 (kto x1's order and
# reference model on sft x2's two ranks), sft-vlm x1 (a whole VLM: its weights restored
# through from_pretrained, trainers/vision.py; its processor in every checkpoint; that
# restore runs in the default lane in test_vlm.py's resumed run, to the eval loss).
# dpo-vlm x1: LoRA on the tiny VLM, as VLMs are trained (TRL's vision preference collator;
# the reference TRL's frozen copy of the starting adapter, saved in every checkpoint's
# ref/ and loaded back beside the trained one: the Trainer's restore of several adapters,
# which no text chain takes; the processor in every checkpoint). It does not cover
# sft-vlm's restore of whole weights (an adapter is the Trainer's own loading). distill-vlm
# x1 (exhaustive): distill x1's path with a whole VLM student and a VLM teacher.
@pytest.mark.parametrize("method,processes", [
    ("sft", 1), ("sft", 2), pytest.param("reward", 2, marks=pytest.mark.exhaustive),
    pytest.param("sft-vlm", 1, marks=pytest.mark.exhaustive), ("dpo-vlm", 1),
    ("dpo", 1), pytest.param("orpo", 2, marks=pytest.mark.exhaustive),
    pytest.param("cpo", 1, marks=pytest.mark.exhaustive), ("kto", 1),
    pytest.param("kto", 2, marks=pytest.mark.exhaustive), ("distill", 1),
    pytest.param("distill-vlm", 1, marks=pytest.mark.exhaustive), ("gkd", 1)])
def test_sigterm_and_sigkill_then_resume_is_bitwise_identical(method, processes, write,
                                                              tmp_path):
    """Four runs per chain: uninterrupted, stopped by SIGTERM (sft x1: Ctrl-C in a
    terminal), killed by SIGKILL, finished.
    Two ranks skip the SIGTERM run: that both save on a signal and resume bitwise is the
    SLURM chain's (test_slurm) and test_launch's USR1/Ctrl-C test's; the kill of both ranks, then
    the resume from the checkpoint they sealed together, is this chain's. Near 60 s for
    x2: three `finetune launch`es, three cold interpreters each."""
    seed = random.randrange(10**6)
    steps = VLM_STEPS if method.endswith("-vlm") else STEPS
    ctrl_c = (method, processes) == ("sft", 1)  # in a terminal: a cold process
    rng = random.Random(seed)
    command = "launch" if processes > 1 else "train"
    extra = f"distill: {{teacher: {tiny_teacher(tmp_path / 'teacher')}}}\n" \
        if method == "distill" else ""
    if method == "distill-vlm":
        extra = f"distill: {{teacher: {tiny_vlm_teacher(tmp_path / 'teacher')}}}\n"
    if method == "gkd":
        extra = ("  lmbda: 0.5\n  max_new_tokens: 8\n"
                 f"distill: {{teacher: {tiny_teacher(tmp_path / 'teacher')}}}\n")
    # Logs every 3 steps, checkpoints every 4: a resume lands inside a logging window.
    reference = write("ref.yaml", experiment("ref", method, processes=processes, steps=steps,
                                             logging_steps=3, extra=extra))
    whole = Run(command, reference, tmp_path, 0)
    assert whole.wait() == 0, whole.text()[-3000:]

    config = write("cut.yaml", experiment("cut", method, processes=processes, steps=steps,
                                          logging_steps=3, extra=extra))
    run_dir = tmp_path / "runs" / "cut"
    term_at = saved_at = None
    if processes == 1:
        term_at = rng.randint(2, min(14, steps - 16))
        if ctrl_c:
            first, name = stopped_by_ctrl_c(command, config, run_dir, tmp_path, term_at), "SIGINT"
            assert "Run the same command again to continue" in first.text()
        else:
            first = stopped_by_sigterm(command, config, run_dir, tmp_path, term_at)
            name = "SIGTERM"
        stopped = json.loads((run_dir / checkpoints.STOPPED).read_text())
        saved_at = stopped["step"]
        assert stopped["signal"] == name and saved_at >= term_at
        assert checkpoints.problem(run_dir / "checkpoints" / f"checkpoint-{saved_at}") is None
        assert f"received {name}" in first.text()

    kill_at = rng.randint(saved_at + 1, min(saved_at + 12, steps - 6)) if saved_at \
        else rng.randint(5, 16)
    second = Run(command, config, tmp_path, 2)
    wait_for_step(second, run_dir, kill_at)
    second.kill_all()
    if saved_at:
        assert f"resuming from {run_dir}/checkpoints/checkpoint-{saved_at}" in second.text()
    sealed = checkpoints.scan(run_dir / "checkpoints").newest
    assert sealed is not None, "the kill left no complete checkpoint"

    third = Run(command, config, tmp_path, 3)
    assert third.wait() == 0, third.text()[-3000:]
    assert f"resuming from {sealed}" in third.text()
    # the output layer tied to the embeddings is stored once: not a "missing key" (run/noise.py)
    assert "There were missing keys" not in second.text() + third.text()
    print(f"{method} x{processes}: a stop at step {term_at} (saved {saved_at}), SIGKILL at "
          f"step {kill_at}, resumed from {sealed.name}, seed {seed}")
    assert_identical(run_dir, tmp_path / "runs" / "ref",
                     f"{method} x{processes}, kill seed {seed}")
    # The run's time counts every attempt up to the checkpoint each resumed from.
    done = re.search(r"finetune: done in ([\d.]+) s \(([\d.]+) s in this attempt\)", third.text())
    assert done and float(done.group(1)) > float(done.group(2)), third.text()[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert abs(summary["seconds"] - float(done.group(1))) < 0.1
    # checkpoints/ holds checkpoints: no library's draft model card (TRL writes one there)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                  if not p.name.startswith("checkpoint-")) == []
    assert [s for s, *_ in losses(run_dir)] == [1, *range(3, steps + 1, 3)]
    if method.endswith("-vlm"):  # the sealed checkpoint loads as a model with its processor
        assert "processor_config.json" in checkpoints.read_manifest(sealed)["files"]
    if method == "dpo-vlm":  # and the reference adapter resumed from it
        assert "ref/adapter_model.safetensors" in checkpoints.read_manifest(sealed)["files"]


# vlm: sft of the tiny LLaVA on rows with images (its processor in the checkpoint). Its
# ZeRO-3 resume is the Trainer's own DeepSpeed loading, the text case's path
# (trainers/vision.py): exhaustive.
@pytest.mark.parametrize("model", ["text", pytest.param("vlm", marks=pytest.mark.exhaustive)])
def test_deepspeed_zero3_checkpoint_then_resume_is_bitwise_identical(model, write, tmp_path):
    """ZeRO-3 checkpoints are written by every rank (sharded states): sealed only once all
    are on disk, and resumed bitwise. Near 40 s: two 2-rank DeepSpeed launches (the
    reference; a run resumed from its checkpoint-8 for 4 steps, a checkpoint-12 of its
    own), each rank importing DeepSpeed cold."""
    text = experiment("z3", "sft", processes=2, steps=12, zero_stage=3).replace(
        "peft: {type: lora, r: 4, dropout: 0.1}\n", "")
    if model == "vlm":
        text = text.replace(str(TINY_MODEL), str(QUICKSTART / "tiny-vlm")).replace(
            "sft_train.jsonl", "vlm_train.jsonl")
    reference = write("z3ref.yaml", text.replace("name: z3", "name: z3ref"))
    assert Run("launch", reference, tmp_path, 0).wait() == 0
    sealed = tmp_path / "runs" / "z3ref" / "checkpoints" / "checkpoint-8"
    assert checkpoints.problem(sealed) is None
    shards = [f for f in checkpoints.read_manifest(sealed)["files"] if "optim_states" in f]
    assert len(shards) == 2, shards  # one optimizer shard per rank, both in the manifest
    config = write("z3.yaml", text + f"resume: {sealed}\n")
    second = Run("launch", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {sealed}" in second.text()
    assert_continues(tmp_path / "runs" / "z3", tmp_path / "runs" / "z3ref", 8, "ZeRO-3")
    if model == "vlm":  # the checkpoint loads as a model with its processor
        assert (sealed / "processor_config.json").is_file()
        assert "processor_config.json" in checkpoints.read_manifest(sealed)["files"]


def _unsealed(run_dir) -> list:
    found = checkpoints.scan(run_dir / "checkpoints")
    return [p for p, why in found.incomplete if "no manifest" in why]


def test_fault_injection_every_kill_point_survives(write, tmp_path):
    """SIGKILL at random instants and in the middle of checkpoint writes (a checkpoint
    directory exists, its manifest does not yet), with save_total_limit 1: after every
    kill a complete checkpoint is left, the next attempt resumes from it, and the run ends
    bitwise equal to an uninterrupted one."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    extra = "  save_steps: 2\n  save_total_limit: 1\n"
    steps = 240
    reference = write("fref.yaml", experiment("fref", "sft", steps=steps).replace(
        "  save_steps: 4\n", "") + extra)
    assert Run("train", reference, tmp_path, 0).wait() == 0
    config = write("fault.yaml", experiment("fault", "sft", steps=steps).replace(
        "  save_steps: 4\n", "") + extra)
    run_dir = tmp_path / "runs" / "fault"

    kills, mid_save, survived = 4, 0, 0
    for attempt in range(1, kills + 1):
        run = Run("train", config, tmp_path, attempt)
        start = losses(run_dir)[-1][0] if losses(run_dir) else 0
        # Step 3 is logged after checkpoint-2 is sealed: only then can a kill leave one.
        wait_for_step(run, run_dir, max(start + 1, 3))
        if attempt % 2:  # at a random instant
            time.sleep(rng.uniform(0, 1.0))
        else:  # while a checkpoint is being written
            deadline = time.monotonic() + 60
            while not _unsealed(run_dir) and time.monotonic() < deadline:
                pass
        caught_mid_save = bool(_unsealed(run_dir))
        run.kill_all()
        mid_save += caught_mid_save
        found = checkpoints.scan(run_dir / "checkpoints")
        assert found.newest is not None, f"attempt {attempt}: no complete checkpoint left"
        # save_total_limit 1, never fewer; two while a kill falls between sealing the new
        # checkpoint and deleting the old one (the next attempt resumes from the newest).
        assert 1 <= len(found.complete) <= 2, found.complete
        survived += 1
    last = Run("train", config, tmp_path, kills + 1)
    assert last.wait() == 0, last.text()[-3000:]
    assert_identical(run_dir, tmp_path / "runs" / "fref", f"fault injection, seed {seed}")
    print(f"fault injection: {survived}/{kills} kills survived ({mid_save} during a checkpoint "
          f"write), seed {seed}")
    assert mid_save >= kills // 2 - 1  # the write window was really hit
    assert len(checkpoints.scan(run_dir / "checkpoints").complete) == 1


def test_two_processes_resume_on_one_with_the_same_global_batch(write, tmp_path):
    """A checkpoint of 2 processes x batch 4 (an uninterrupted run's checkpoint-8),
    continued by 1 process x batch 4 x accumulation 2: the data goes on from the right
    sample (the weights match the 2-process run to rounding), with a warning that says what
    changes. Without dropout (reward, full fine-tuning) only the reduction order differs.
    One 2-process launch and two one-process runs."""
    two = experiment("two", "reward", processes=2, steps=24)
    assert Run("launch", write("two.yaml", two), tmp_path, 0).wait() == 0
    checkpoint = tmp_path / "runs" / "two" / "checkpoints" / "checkpoint-8"
    run_dir = tmp_path / "runs" / "moved"

    halved = write("halved.yaml", experiment("moved", "reward", steps=24)
                   + f"resume: {checkpoint}\n")
    refused = run_cli("train", str(halved), cwd=tmp_path)
    assert refused.returncode == 2 and "global batch: 8 -> 4" in refused.stderr
    assert "Traceback" not in refused.stderr

    one = write("one.yaml", experiment("moved", "reward", steps=24, accumulation=2)
                + f"resume: {checkpoint}\n")
    result = run_cli("train", str(one), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: the checkpoint was written by 2 process(es) x batch 4 x accumulation 1; " \
           "this run is 1 process(es) x batch 4 x accumulation 2 (global batch 8" in result.stdout
    a, b = final_weights(run_dir), final_weights(tmp_path / "runs" / "two")
    worst = max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)
    print(f"2 -> 1 process resume: weights rel. diff to an uninterrupted 2-process run "
          f"{worst:.2e}")
    assert worst <= 1e-5
    assert [s for s, *_ in losses(run_dir)] == list(range(9, 25))


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(write, tmp_path):
    """The run directory sits on a 14 MiB tmpfs: the first checkpoint fits, the second
    does not. The error says so, the first stays complete; with space added, the run
    continues from it and ends as if nothing happened."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs (not root here)")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(small)], check=True)
    try:
        text = experiment("full", "sft", steps=12).replace(
            "peft: {type: lora, r: 4, dropout: 0.1}\n", "")  # full weights: big checkpoints
        reference = write("nofull.yaml", text.replace("name: full", "name: nofull"))
        assert Run("train", reference, tmp_path, 0).wait() == 0
        config = write("full.yaml", text.replace(
            "output: {plot: false}", f"output: {{dir: {small / 'run'}, plot: false}}"))
        result = run_cli("train", str(config), cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        message = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
        assert "no space left on the device" in message and "while writing checkpoint-8" in \
            message and "checkpoint-4, is intact" in message, message
        found = checkpoints.scan(small / "run" / "checkpoints")
        assert [p.name for p in found.complete] == ["checkpoint-4"]

        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        result = run_cli("train", str(config), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "ignoring incomplete checkpoint-8" in result.stdout
        assert_identical(small / "run", tmp_path / "runs" / "nofull", "after a full disk")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_weighted_classify_sigterm_then_resume_is_bitwise_identical(write, tmp_path):
    """Our own weighted Trainer (class weights x sample weights, focal loss) with
    accumulation: stopped by SIGTERM, resumed, bitwise equal. One process: two ranks'
    resume is sft x2's chain, the weighted loss across ranks test_weighted's layouts."""
    rows = [json.loads(line) for line in
            (DATA / "classify_train.jsonl").read_text().splitlines()[:24]]
    data = write("weighted.jsonl", "".join(
        json.dumps({**row, "w": [1.0, 0.5, 2.0, 0.0][i % 4]}) + "\n" for i, row in enumerate(rows)))
    text = (f"method: classify\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data: {{train: {data}, weight_column: w}}\n"
            "classify: {labels: [early, middle, late], class_weights: balanced, "
            "focal_gamma: 1.0}\n"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            "training: {max_steps: 24, per_device_train_batch_size: 2, "
            "gradient_accumulation_steps: 2, learning_rate: 1e-3, logging_steps: 3, "
            "save_steps: 4, seed: 5}\n")
    reference = write("wref.yaml", f"name: wref\n{text}")
    assert Run("train", reference, tmp_path, 0).wait() == 0
    config = write("wcut.yaml", f"name: wcut\n{text}")
    run_dir = tmp_path / "runs" / "wcut"
    stopped_by_sigterm("train", config, run_dir, tmp_path, random.randint(2, 10))
    second = Run("train", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert "resuming from" in second.text()
    assert_identical(run_dir, tmp_path / "runs" / "wref", "weighted classify")


def test_changed_data_content_is_refused_on_resume_unless_forced(write, tmp_path):
    """The same path, other rows: the checkpoint's fingerprint holds the data's content."""
    data = tmp_path / "train.jsonl"
    data.write_bytes((DATA / "sft_train.jsonl").read_bytes())
    config = write("data.yaml", (
        f"name: data\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {{path: {data}, max_samples: 8}}}}\n"
        "evaluation: {before_training: false}\noutput: {plot: false, save_final: false}\n"
        "training: {max_steps: 2, save_steps: 2, per_device_train_batch_size: 2, "
        "max_length: 32, logging_steps: 1}\n"))
    first = run_cli("train", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "runs" / "data" / "checkpoints" / "checkpoint-2"
    assert checkpoints.problem(checkpoint) is None

    # A requeued job of the finished run (killed after summary.json, say): done, exit 0,
    # nothing rewritten; the launcher's path says the same.
    bundle = {p: p.read_bytes() for p in checkpoint.parent.parent.glob("*") if p.is_file()}
    for command in ("train", "launch"):
        again = run_cli(command, str(config), cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "holds this run, finished (summary.json, step 2); nothing to do" in again.stdout
        assert {p: p.read_bytes() for p in bundle} == bundle

    rows = data.read_text().splitlines(keepends=True)
    data.write_text("".join(rows[1:] + rows[:1]))  # a reordered copy, same size
    go_on = [f"resume={checkpoint}", "training.max_steps=3"]
    refused = run_cli("train", str(config), *go_on, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert f"cannot resume from {checkpoint}" in refused.stderr
    assert f"  data content {data}: '" in refused.stderr and "force_resume: true" in refused.stderr

    forced = run_cli("train", str(config), *go_on, "force_resume=true", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert f"force_resume: continuing although these changed:\n  data content {data}" in \
        forced.stdout + forced.stderr
