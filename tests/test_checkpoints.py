"""Checkpoint sealing, verification, rotation and the resume decision, on real files
(no training): what a kill at any point of a save leaves behind, and what resume makes
of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import DATA, TINY_MODEL, run_cli
from finetune.rundir import checkpoints
from finetune.config import load_experiment
from finetune.errors import RunError, RunFinished
from finetune.fileio.atomic import write_atomic
from finetune.config.schema import Experiment
from finetune.rundir.fingerprint import differences, fingerprint, layout
from finetune.rundir.resume import plan_resume


def fake_checkpoint(root: Path, step: int, exp=None, seal: bool = True) -> Path:
    path = root / "checkpoints" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if seal:
        extra = {"fingerprint": fingerprint(exp), "layout": layout(exp)} if exp else \
            {"fingerprint": {}}
        checkpoints.write_manifest(path, step, extra)
    return path


def make_experiment(write, extra: str = "", name: str = "run"):
    config = write(f"{name}.yaml", (
        f"name: {name}\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {DATA}/sft_train.jsonl}}\n"
        "training: {max_steps: 10, per_device_train_batch_size: 4, seed: 1, "
        "learning_rate: 1e-3}\n" + extra))
    return load_experiment(config)


def test_a_sealed_checkpoint_verifies_and_any_damage_is_named(tmp_path):
    path = fake_checkpoint(tmp_path, 5)
    assert checkpoints.problem(path) is None
    manifest = checkpoints.read_manifest(path)
    assert manifest["step"] == 5 and set(manifest["files"]) == {"model.safetensors",
                                                                "trainer_state.json"}

    data = path / "model.safetensors"
    original = data.read_bytes()
    data.write_bytes(original[:100])  # truncated, as by a kill mid-write
    assert "model.safetensors has 100 bytes, the manifest says 16384" == checkpoints.problem(path)
    data.write_bytes(original[:-1] + b"\x00")  # same size, other bytes (hashed: small file)
    assert "does not match its SHA-256" in checkpoints.problem(path)
    data.unlink()
    assert checkpoints.problem(path) == "model.safetensors is missing"
    (path / checkpoints.MANIFEST).write_text("{not json")
    assert "unreadable manifest" in checkpoints.problem(path)


def test_an_unsealed_checkpoint_is_incomplete_and_never_chosen(tmp_path):
    fake_checkpoint(tmp_path, 5)
    fake_checkpoint(tmp_path, 10, seal=False)  # killed before its manifest
    found = checkpoints.scan(tmp_path / "checkpoints")
    assert [p.name for p in found.complete] == ["checkpoint-5"]
    assert [(p.name, why) for p, why in found.incomplete] == [
        ("checkpoint-10", "no manifest: its writing did not finish")]
    assert found.newest.name == "checkpoint-5"


def test_rotation_keeps_the_newest_sealed_and_the_best_and_ignores_unsealed(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    partial = fake_checkpoint(tmp_path, 10, seal=False)
    best = tmp_path / "checkpoints" / "checkpoint-2"
    removed = checkpoints.rotate(tmp_path / "checkpoints", 1, {best.resolve()})
    assert sorted(p.name for p in removed) == ["checkpoint-4", "checkpoint-6"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["checkpoint-10", "checkpoint-2", "checkpoint-8"]
    assert partial.exists()  # not ours to judge while it may still be written
    assert checkpoints.rotate(tmp_path / "checkpoints", None, set()) == []


def test_a_manifest_is_replaced_atomically(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    assert not list(path.glob(".*.tmp"))
    checkpoints.write_manifest(path, 3, {"fingerprint": {}})
    assert checkpoints.problem(path) is None and not list(path.glob(".*.tmp"))


def test_resume_auto_picks_the_newest_complete_checkpoint(write, tmp_path):
    exp = make_experiment(write)
    run = tmp_path / "r"
    assert plan_resume(exp, run).checkpoint is None  # an empty run directory starts fresh
    fake_checkpoint(run, 4, exp)
    fake_checkpoint(run, 8, exp)
    fake_checkpoint(run, 12, exp, seal=False)
    plan = plan_resume(exp, run)
    assert plan.checkpoint.name == "checkpoint-8" and plan.step == 8
    assert [p.name for p in plan.incomplete] == ["checkpoint-12"]
    assert any("ignoring incomplete checkpoint-12 (no manifest" in n for n in plan.notes)
    assert any("resuming from" in n and "checkpoint-8" in n for n in plan.notes)


def test_resume_never_refuses_a_directory_with_checkpoints(write, tmp_path):
    exp = make_experiment(write, "resume: never\n")
    fake_checkpoint(tmp_path / "r", 4, exp)
    with pytest.raises(RunError, match=r"already holds 1 checkpoint\(s\).*resume: never"):
        plan_resume(exp, tmp_path / "r")


def test_a_finished_run_is_done_for_auto_and_more_steps_are_an_error(write, tmp_path):
    exp = make_experiment(write)
    run = tmp_path / "r"
    fake_checkpoint(run, 10, exp)
    (run / "summary.json").write_text(json.dumps({"global_step": 10}))
    with pytest.raises(RunFinished, match="holds this run, finished .*step 10.*nothing to do"):
        plan_resume(exp, run)
    more = exp.model_copy(update={"training": {**exp.training, "max_steps": 20}})
    with pytest.raises(RunError, match=r"holds a finished run \(summary.json, step 10\) and "
                                       "training.max_steps is 20"):
        plan_resume(more, run)


@pytest.mark.parametrize("text,cause", [
    ('{"global_step": 1', "Expecting ',' delimiter"),
    ("[]", "no global_step number in it"),
    ('{"global_step": "ten"}', "no global_step number in it"),
    ('{"global_step": null}', "no global_step number in it"),
    ("[" * 100000, "nested too deeply"),
    (b"\xff\xfe{", "'utf-8' codec can't decode byte 0xff"),
])
def test_a_damaged_summary_is_an_error_naming_the_file(write, tmp_path, text, cause):
    run = tmp_path / "r"
    run.mkdir()
    summary = run / "summary.json"
    summary.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RunError) as info:
        plan_resume(make_experiment(write), run)
    assert str(info.value).startswith(f"{summary}: damaged ({cause}"), str(info.value)


def _edited(**changes):
    """A manifest as write_manifest wrote it, then edited: key=None deletes the key."""
    def edit(manifest):
        manifest = {**manifest, **changes}
        return json.dumps({k: v for k, v in manifest.items() if v is not None})
    return edit


def _extra_file(name):
    return lambda m: json.dumps({**m, "files": {**m["files"], name: {"size": 1}}})


@pytest.mark.parametrize("edit,why", [
    (lambda m: "[]", "unreadable manifest {} (a JSON object expected, got list)"),
    (lambda m: json.dumps(m)[:40], "unreadable manifest {} (Unterminated string"),
    (lambda m: "[" * 100000, "unreadable manifest {} (nested too deeply)"),
    (_edited(step="4"), "unreadable manifest {} (`step` is '4', not a step number"),
    (_edited(files=None), "unreadable manifest {} (`files` is not an object listing"),
    (_edited(files={}), "unreadable manifest {} (`files` is not an object listing"),
    (_edited(files={"model.safetensors": 5}), "unreadable manifest {} (`files.model.safetens"),
    (lambda m: json.dumps({**m, "files": {"model.safetensors": m["files"]["model.safetensors"]}}),
     "unreadable manifest {} (`files` lacks trainer_state.json, which the Trainer resumes"),
    (_extra_file("a\0b"), "unreadable manifest {} (`files` names 'a\\x00b', not a path"),
    (_extra_file("."), "unreadable manifest {} (`files` names '.', not a path inside"),
    (_extra_file("/etc/passwd"), "unreadable manifest {} (`files` names '/etc/passwd', not"),
    (_extra_file("../checkpoint-2/model.safetensors"), "unreadable manifest {} (`files` names"),
    (_extra_file("x" * 300), "unreadable manifest {} (`files` names 'xxxx"),
    (_edited(fingerprint=None), "unreadable manifest {} (`fingerprint` is missing or not an"),
    (_edited(fingerprint=[]), "unreadable manifest {} (`fingerprint` is missing or not an"),
    (_edited(layout={"processes": 1}), "unreadable manifest {} (`layout` is not the processes"),
    (_edited(step=2), "named checkpoint-4, its manifest says step 2"),
    (_extra_file("sub"), "sub is not a file"),
], ids=["list", "truncated", "deep", "step-text", "no-files", "files-empty", "entry-number",
        "no-trainer-state", "name-nul", "name-dot", "name-absolute", "name-parent",
        "name-long", "no-fingerprint", "fingerprint-list", "layout", "step-edited",
        "directory-listed"])
def test_a_damaged_manifest_moves_its_checkpoint_aside(write, tmp_path, edit, why):
    """A manifest is written atomically and last: one that exists but is damaged is not
    what a kill leaves. Its checkpoint is moved aside, never deleted; the run continues
    from the newest intact one; naming it as resume: path is an error."""
    exp = make_experiment(write)
    run = tmp_path / "r"
    fake_checkpoint(run, 2, exp)
    damaged = fake_checkpoint(run, 4, exp)
    (damaged / "sub").mkdir()
    manifest = damaged / checkpoints.MANIFEST
    manifest.write_text(edit(json.loads(manifest.read_text())))
    plan = plan_resume(exp, run)
    assert plan.checkpoint.name == "checkpoint-2" and plan.incomplete == []
    assert plan.damaged == [(damaged, damaged.parent / "damaged-checkpoint-4")]
    note = next(n for n in plan.notes if n.startswith("checkpoint-4 is damaged"))
    assert note.startswith(f"checkpoint-4 is damaged ({why.format(manifest)}"), note
    assert note.endswith("moving it aside to checkpoints/damaged-checkpoint-4: kept, never "
                         "resumed from")
    named = make_experiment(write, f"resume: {damaged}\n", name="n")
    with pytest.raises(RunError, match="cannot be resumed from: "):
        plan_resume(named, tmp_path / "n")


def test_a_kill_mid_save_is_incomplete_and_damage_is_not(write, tmp_path):
    """Without a manifest: a save cut short, removed. With one, but files that disagree
    with it (a file truncated, deleted, or a step edited away from trainer_state.json):
    damage, moved aside under a name no scan or rotation reads; when nothing intact is
    left, the note says training starts from scratch."""
    exp = make_experiment(write)
    run = tmp_path / "r"
    truncated = fake_checkpoint(run, 2, exp)
    (truncated / "model.safetensors").write_bytes(b"short")
    edited = fake_checkpoint(run, 4, exp)
    (edited / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    checkpoints.write_manifest(edited, 4, {"fingerprint": fingerprint(exp)})
    partial = fake_checkpoint(run, 6, exp, seal=False)
    (run / "checkpoints" / "damaged-checkpoint-2").mkdir()  # moved aside by an earlier start
    plan = plan_resume(exp, run)
    assert plan.checkpoint is None and plan.incomplete == [partial]
    assert plan.damaged == [(truncated, truncated.parent / "damaged-checkpoint-2-2"),
                            (edited, edited.parent / "damaged-checkpoint-4")]
    assert "checkpoint-2 is damaged (model.safetensors has 5 bytes, the manifest says " \
           "16384)" in plan.notes[1]
    assert "checkpoint-4 is damaged (the manifest says step 4, trainer_state.json says 3)" \
        in plan.notes[2]
    assert plan.notes[-1] == "no intact checkpoint left: training starts from scratch (step 0)"
    for path, to in plan.damaged:  # what rank 0 does at the start (worker._start_attempt)
        path.rename(to)
    assert checkpoints.rotate(run / "checkpoints", 1, set()) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "checkpoint-6", "damaged-checkpoint-2", "damaged-checkpoint-2-2",
        "damaged-checkpoint-4"]
    found = checkpoints.scan(run / "checkpoints")
    assert (found.complete, found.damaged) == ([], [])


def test_a_checkpoint_file_that_cannot_be_read_is_an_error_naming_it(write, tmp_path,
                                                                   monkeypatch):
    """Not damage but access (another user's files): nothing is moved, one error. Root reads
    anything, so the refusal is simulated where the checkpoint's files are read."""
    exp = make_experiment(write)
    path = fake_checkpoint(tmp_path / "r", 2, exp)

    def refused(file):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(checkpoints, "sha256_of", refused)
    with pytest.raises(RunError) as info:
        plan_resume(exp, tmp_path / "r")
    assert str(info.value).startswith(f"cannot read {path / 'model.safetensors'} (Permission "
                                      "denied)")
    assert "Nothing was changed" in str(info.value)


def test_a_fingerprint_without_a_method_compares_without_an_error(write):
    exp = make_experiment(write)
    assert "training.seed: '<not set>' -> 1" in differences({"data.format": "auto"},
                                                           fingerprint(exp))


def test_resume_path_is_verified_and_superseded_by_newer_own_checkpoints(write, tmp_path):
    other = fake_checkpoint(tmp_path / "other", 4, make_experiment(write))
    exp = make_experiment(write, f"resume: {other}\n")
    assert plan_resume(exp, tmp_path / "r").checkpoint == other
    fake_checkpoint(tmp_path / "r", 6, exp)  # this run went on from it (a requeued job)
    plan = plan_resume(exp, tmp_path / "r")
    assert plan.checkpoint.name == "checkpoint-6" and plan.step == 6
    assert any("newer than resume" in n for n in plan.notes)

    broken = fake_checkpoint(tmp_path / "broken", 4, exp, seal=False)
    exp = make_experiment(write, f"resume: {broken}\n", name="b")
    with pytest.raises(RunError, match="cannot be resumed from: no manifest"):
        plan_resume(exp, tmp_path / "b")


def test_changes_to_what_is_trained_are_refused_with_a_diff_unless_forced(write, tmp_path):
    run = tmp_path / "r"
    fake_checkpoint(run, 4, make_experiment(write))
    changed = make_experiment(write, "peft: {type: lora}\n").model_copy(
        update={"training": {"max_steps": 10, "per_device_train_batch_size": 4, "seed": 2,
                             "learning_rate": 1e-3}})
    with pytest.raises(RunError) as refused:
        plan_resume(changed, run)
    message = str(refused.value)
    assert "peft.type: 'none' -> 'lora'" in message and "training.seed: 1 -> 2" in message
    assert "force_resume: true" in message and "Nothing was changed" in message
    forced = changed.model_copy(update={"force_resume": True})
    plan = plan_resume(forced, run)
    assert plan.checkpoint.name == "checkpoint-4"
    assert any(n.startswith("force_resume") and "training.seed" in n for n in plan.notes)


def test_an_fsdp_checkpoint_is_not_read_as_another_fsdp_format():
    exp = lambda fsdp: Experiment.model_validate({
        "name": "f", "method": "sft", "model": {"name_or_path": "m"},
        "data": {"train": "d.jsonl"},
        "distributed": {"strategy": "fsdp", "num_processes": 2, "fsdp": fsdp}})
    sharded = fingerprint(exp({}))
    assert sharded["checkpoint format"] == "fsdp"
    assert differences(sharded, fingerprint(exp({"version": 1}))) == [
        "distributed.fsdp.version: 2 -> 1"]
    assert differences(sharded, fingerprint(exp({"state_dict_type": "FULL_STATE_DICT"}))) == [
        "distributed.fsdp.state_dict_type: 'SHARDED_STATE_DICT' -> 'FULL_STATE_DICT'"]
    assert differences(sharded, fingerprint(exp({"cpu_offload": True}))) == []


def test_harmless_changes_resume_silently(write, tmp_path):
    run = tmp_path / "r"
    fake_checkpoint(run, 4, make_experiment(write))
    harmless = make_experiment(write, "evaluation: {before_training: false}\n").model_copy(
        update={"training": {"max_steps": 50, "per_device_train_batch_size": 4, "seed": 1,
                             "learning_rate": 1e-3, "logging_steps": 7, "save_steps": 3,
                             "save_total_limit": 2, "report_to": "none"}})
    plan = plan_resume(harmless, run)
    assert plan.checkpoint.name == "checkpoint-4"
    assert not any("force_resume" in n or "warning" in n for n in plan.notes)


def test_same_global_batch_on_another_layout_resumes_with_a_warning(write, tmp_path):
    run = tmp_path / "r"
    two = make_experiment(write, "distributed: {strategy: ddp, num_processes: 2}\n")
    fake_checkpoint(run, 4, two)
    one = make_experiment(write).model_copy(update={"training": {
        "max_steps": 10, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "seed": 1, "learning_rate": 1e-3}})
    plan = plan_resume(one, run)
    warning = next(n for n in plan.notes if n.startswith("warning"))
    assert "2 process(es) x batch 4 x accumulation 1" in warning
    assert "1 process(es) x batch 4 x accumulation 2" in warning and "global batch 8" in warning
    assert "random streams (dropout) restart" in warning

    smaller = make_experiment(write)  # 1 x 4 x 1: global batch 4, not 8
    with pytest.raises(RunError, match="global batch: 8 -> 4"):
        plan_resume(smaller, run)


def test_data_replaced_at_the_same_path_is_refused_with_a_diff(write, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes((DATA / "sft_train.jsonl").read_bytes())
    config = write("run.yaml", f"name: run\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\n")
    run = tmp_path / "r"
    fake_checkpoint(run, 4, load_experiment(config))
    os.utime(data, (1, 1))  # touched or copied: the same content resumes
    assert plan_resume(load_experiment(config), run).checkpoint.name == "checkpoint-4"
    before = fingerprint(load_experiment(config))[f"data content {data}"]
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(reversed(lines)))  # same size, other order
    with pytest.raises(RunError) as refused:
        plan_resume(load_experiment(config), run)
    after = fingerprint(load_experiment(config))[f"data content {data}"]
    assert before.split(",")[0] == after.split(",")[0] and before != after
    assert f"data content {data}: {before!r} -> {after!r}" in str(refused.value)
    forced = load_experiment(config, ["force_resume=true"])
    assert plan_resume(forced, run).checkpoint.name == "checkpoint-4"


def test_a_checkpoint_from_before_data_content_was_recorded_still_resumes(write, tmp_path):
    exp = make_experiment(write)
    old = {k: v for k, v in fingerprint(exp).items() if not k.startswith("data content")}
    assert len(old) < len(fingerprint(exp))
    assert differences(old, fingerprint(exp)) == []


def test_a_large_data_file_is_hashed_from_samples(tmp_path):
    from finetune.data.files import HASHED_WHOLE, content_digest

    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (HASHED_WHOLE + 1))
    digest = content_digest(big)
    assert digest.startswith(f"{HASHED_WHOLE + 1} bytes, sampled sha256 ")
    with big.open("r+b") as handle:
        handle.seek(HASHED_WHOLE)  # the last bytes are always sampled
        handle.write(b"y")
    assert content_digest(big) != digest


def test_cli_a_damaged_summary_is_one_error_line(write, tmp_path):
    config = write("run.yaml", f"name: run\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {DATA}/sft_train.jsonl}}\n")
    summary = tmp_path / "runs" / "run" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text('{"global_step": ')
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {summary}: damaged (Expecting value")
    assert sorted(p.name for p in summary.parent.iterdir()) == ["summary.json"]


def test_write_atomic_is_not_blocked_by_leftovers_and_names_what_it_cannot_write(tmp_path):
    """A kill can leave a staging file (or a user a directory named like one) behind: the
    next write does not trip over it; a directory where the file goes is one RunError."""
    import os
    import stat as stat_module

    target = tmp_path / "summary.json"
    (tmp_path / ".summary.json.tmp").mkdir()
    write_atomic(target, "{}\n")
    assert target.read_text() == "{}\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat_module.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open() makes it
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(RunError, match=r"cannot write .*metrics\.jsonl"):
        write_atomic(tmp_path / "metrics.jsonl", "x\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".summary.json.tmp", "metrics.jsonl",
                                                          "summary.json"]


def test_a_tensor_parallel_checkpoint_is_not_read_by_another_group_size():
    """AutoTP's optimizer states are shards of the group: another tensor_parallel reads
    other files. The global batch counts data parallel groups only."""
    exp = lambda tp, processes: Experiment.model_validate({
        "name": "t", "method": "sft", "model": {"name_or_path": "m"},
        "data": {"train": "d.jsonl"},
        "distributed": {"strategy": "deepspeed", "num_processes": processes,
                        "tensor_parallel": tp, "deepspeed": {"zero_stage": 1}}})
    split = fingerprint(exp(2, 4))
    assert differences(split, fingerprint(exp(1, 2))) == ["distributed.tensor_parallel: 2 -> 1"]
    assert differences(fingerprint(exp(1, 2)), split) == ["distributed.tensor_parallel: 1 -> 2"]
    assert layout(exp(2, 4))["global_batch"] == layout(exp(1, 2))["global_batch"]
