"""method kto (TRL's KTOTrainer): unpaired rows (prompt, completion, bool label) and
preference pairs read as two unpaired rows each; full fine-tuning, LoRA and QLoRA into a
complete run directory; a separate reference model; the KL term's batch rules and the
refusal of per-sample weights at validate; bad rows named by file, row and field; data
parallelism measured against one big batch; learning on the quickstart pairs. Exact
resume is in test_resume.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import DATA, QUICKSTART, REPO, TINY_MODEL, free_port, run_cli

STEPS = 3


def pairs(count: int, source: str = "pref_train") -> list[dict]:
    lines = (DATA / f"{source}.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def unpaired_rows(count: int, text: bool = False, source: str = "pref_train") -> list[dict]:
    """The quickstart pairs as unpaired rows, alternating desirable and undesirable;
    text: the message contents as plain text."""
    rows = []
    for i, pair in enumerate(pairs(count, source)):
        answer = "chosen" if i % 2 == 0 else "rejected"
        prompt, completion = pair["prompt"], pair[answer]
        if text:
            prompt, completion = prompt[0]["content"] + "\n", completion[0]["content"]
        rows.append({"prompt": prompt, "completion": completion, "label": answer == "chosen"})
    return rows


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def experiment(peft: str = "none", train: str = f"{DATA}/pref_train.jsonl",
               extra: str = "", top: str = "", batch: int = 8,
               evaluation: str = f"{DATA}/pref_eval.jsonl") -> str:
    peft_block = f"peft:\n  type: {peft}\n  r: 4\n" if peft != "none" else ""
    return (f"method: kto\nmodel:\n  name_or_path: {TINY_MODEL}\n  init: random\n"
            f"{peft_block}{top}data:\n  train: {{path: {train}, max_samples: 48}}\n"
            f"  eval: {{path: {evaluation}, max_samples: 16}}\n"
            f"output: {{plot: false}}\n"
            f"training:\n  max_steps: {STEPS}\n  per_device_train_batch_size: {batch}\n"
            "  logging_steps: 1\n  learning_rate: 1e-3\n  max_length: 64\n" + extra)


@pytest.mark.slow
@pytest.mark.parametrize("peft,data", [("none", "pairs"), ("lora", "unpaired-chat"),
                                       ("qlora", "unpaired-text")])
def test_train_writes_a_complete_run_directory(peft, data, write, tmp_path):
    train, evaluation = f"{DATA}/pref_train.jsonl", f"{DATA}/pref_eval.jsonl"
    if data != "pairs":  # every file of a run in one format: eval rows unpaired too
        text = data.endswith("text")
        train = str(jsonl(tmp_path / "u.jsonl", unpaired_rows(48, text)))
        evaluation = str(jsonl(tmp_path / "e.jsonl", unpaired_rows(32, text, "pref_eval")))
    config = write(f"kto-{peft}.yaml", experiment(peft, train, evaluation=evaluation))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data format unpaired_preference" in result.stdout
    # Pairs become two rows each; the data layer says so.
    assert ("48 training and 16 eval preference pair(s) read as unpaired rows"
            in result.stdout) is (data == "pairs")
    assert f"{96 if data == 'pairs' else 48} train rows, {32 if data == 'pairs' else 16} " \
           "eval rows" in result.stdout
    run = tmp_path / "runs" / f"kto-{peft}"
    assert yaml.safe_load((run / "experiment.yaml").read_text())["method"] == "kto"
    args = json.loads((run / "training_args.json").read_text())
    assert (args["loss_type"], args["train_sampling_strategy"]) == ("kto", "sequential")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and all(isinstance(x, float) and x == x for x in losses)
    assert all("kl" in r for r in records if "loss" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == STEPS
    assert summary["before"]["eval_loss"] != summary["after"]["eval_loss"]
    assert "eval_rewards/margins" in summary["after"]  # both labels in the eval batches
    final = run / "final"
    weights = "model.safetensors" if peft == "none" else "adapter_model.safetensors"
    assert (final / weights).exists() and (final / "tokenizer.json").exists()
    if peft != "none":
        assert f"peft {peft}" in result.stdout and "(100.00%)" not in result.stdout
    if peft == "lora":
        # TRL's reference is a frozen copy of the starting adapter (`ref`): the last
        # checkpoint keeps it for a resume, final/ holds the trained adapter only
        last = run / "checkpoints" / f"checkpoint-{STEPS}"
        assert (last / "ref" / "adapter_model.safetensors").is_file()
        assert not (final / "ref").exists()
        adapter, trained = (load_file(d / weights) for d in (final, last))
        assert adapter.keys() == trained.keys() and len(adapter) > 0
        assert all(torch.equal(adapter[k], trained[k]) for k in adapter)
    assert "finetune: done in" in result.stdout


@pytest.mark.slow
def test_a_separate_reference_model_is_used(write, tmp_path):
    """kto.ref_model: a run's final model as the reference of a LoRA run. Its policy
    starts elsewhere (random init), so the rewards differ from 0 before any step."""
    first = write("kto-none.yaml", experiment("none"))
    assert run_cli("train", str(first), cwd=tmp_path).returncode == 0
    config = write("with-ref.yaml", experiment(
        "lora", top=f"kto: {{ref_model: {tmp_path}/runs/kto-none/final}}\n"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    before = json.loads((tmp_path / "runs" / "with-ref" / "summary.json").read_text())["before"]
    assert before["eval_rewards/chosen"] != 0 and before["eval_rewards/rejected"] != 0


@pytest.mark.slow
def test_learns_the_quickstart_preferences(tmp_path):
    """The quickstart's dpo run (150 steps, random init) with method kto, its pairs read
    as unpaired rows: on held-out rows the desirable completions' reward rises, the
    undesirable ones' falls, and their margin grows from 0."""
    result = run_cli("train", str(QUICKSTART / "dpo.yaml"), "method=kto", "name=q-kto",
                     cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "q-kto" / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    print(f"kto eval margin {before['eval_rewards/margins']:.4g} -> "
          f"{after['eval_rewards/margins']:.4g}, loss {before['eval_loss']:.4g} -> "
          f"{after['eval_loss']:.4g}, in {summary['seconds']} s")
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 1.0
    assert after["eval_rewards/chosen"] > 0 > after["eval_rewards/rejected"]
    assert after["eval_loss"] < before["eval_loss"] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("extra,where,says", [
    ("", "training.per_device_train_batch_size",
     "at least 2: loss_type kto estimates its KL term from mismatched prompt/completion "
     "pairs within each per-device batch"),
    ("  train_sampling_strategy: random\n", "training.train_sampling_strategy",
     "must be sequential"),
    ("  auto_find_batch_size: true\n", "training.auto_find_batch_size", "not supported"),
])
def test_impossible_kl_batches_are_refused_at_validate(extra, where, says, write, tmp_path):
    config = write("bad.yaml", experiment(extra=extra, batch=1 if not extra else 8))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert where in result.stderr and says in result.stderr, result.stderr


@pytest.mark.slow
def test_the_unpaired_loss_without_kl_takes_any_batch(write, tmp_path):
    config = write("apo.yaml", experiment(extra="  loss_type: apo_zero_unpaired\n"
                                                "  train_sampling_strategy: random\n",
                                          batch=1))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_weights_and_foreign_sections_are_refused(write, tmp_path):
    config = write("w.yaml", experiment().replace("max_samples: 48}",
                                                  "max_samples: 48}\n  weight_column: w"))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "data.weight_column: not used by method kto: its trainer has no per-sample loss " \
           "weights" in result.stderr
    dpo = write("dpo.yaml", experiment(top="kto: {ref_model: somewhere}\n").replace(
        "method: kto", "method: dpo"))
    result = run_cli("validate", str(dpo), cwd=tmp_path)
    assert result.returncode == 2 and "kto: options for method kto, but method is dpo" \
        in result.stderr, result.stderr
    missing = write("ref.yaml", experiment(top=f"kto: {{ref_model: {tmp_path}/none}}\n"))
    result = run_cli("validate", str(missing), cwd=tmp_path)
    assert result.returncode == 2 and "kto.ref_model" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("row,says", [
    ({"label": 1}, "u.jsonl row 2: `label` must be true (a desirable completion) or false "
                   "(an undesirable one), got int 1"),
    ({"label": "yes"}, "u.jsonl row 2: `label` must be true"),
    ({"completion": None}, "u.jsonl row 2: missing `completion`"),
    ({"completion": [{"role": "assistant"}]}, "u.jsonl row 2: `completion[0]` must have "
                                              "`role` and `content`"),
])
def test_a_bad_row_is_named_by_file_row_and_field(row, says, write, tmp_path):
    rows = unpaired_rows(6)
    rows[1] = {**rows[1], **row}
    train = jsonl(tmp_path / "u.jsonl", rows)
    config = write("bad.yaml", experiment(train=str(train)))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert says in result.stderr, result.stderr


@pytest.mark.slow
def test_unpaired_needs_its_label_and_sft_reads_prompt_completion(write, tmp_path):
    """Without `label` the rows are not kto's; sft reads prompt/completion and ignores it."""
    rows = unpaired_rows(6)
    train = jsonl(tmp_path / "nolabel.jsonl",
                  [{k: v for k, v in r.items() if k != "label"} for r in rows])
    result = run_cli("train", str(write("k.yaml", experiment(train=str(train)))), cwd=tmp_path)
    assert result.returncode == 2
    assert "method kto needs columns prompt/completion/label or chosen/rejected" \
        in result.stderr, result.stderr


@pytest.mark.slow
def test_estimate_holds_a_reference_copy_under_full_fine_tuning_only(write, tmp_path):
    held = {}
    for peft in ("none", "lora"):
        result = run_cli("estimate", str(write(f"{peft}.yaml", experiment(peft))), "--json",
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        held[peft] = json.loads(result.stdout)["configured"]["bytes"]
    assert held["none"]["reference"] == held["none"]["trainable"] > 0
    assert held["lora"]["reference"] == 0


def test_example_config_validates(online, tmp_path):
    result = run_cli("validate", str(REPO / "configs" / "examples" / "qwen2.5-0.5b-kto-lora.yaml"),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr


# Data parallelism: 2 processes x batch 2 against 1 process x batch 4 (and x batch 2 x
# accumulation 2), fp32 SGD, the training set one global batch (rows are read in order).
LAYOUTS = {"ddp-2x2": (2, 2, 1), "single-1x4": (1, 4, 1), "accum-1x2x2": (1, 2, 2)}


def _parallel(layout: str, train: Path, loss: str, write, tmp_path) -> dict:
    processes, batch, accumulation = LAYOUTS[layout]
    name = f"{loss}-{layout}"
    distributed = (f"distributed: {{strategy: ddp, num_processes: {processes}, device: cpu, "
                   f"main_process_port: {free_port()}}}\n" if processes > 1 else "")
    config = write(f"{name}.yaml", (
        f"name: {name}\nmethod: kto\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data:\n  train: {train}\n{distributed}evaluation: {{before_training: false}}\n"
        "output: {plot: false}\n"
        f"training:\n  max_steps: 3\n  per_device_train_batch_size: {batch}\n"
        f"  gradient_accumulation_steps: {accumulation}\n  optim: sgd\n  learning_rate: 0.5\n"
        "  lr_scheduler_type: constant\n  weight_decay: 0.0\n  max_grad_norm: 0.0\n"
        f"  loss_type: {loss}\n  beta: 1.0\n  activation_checkpointing: false\n"
        "  logging_steps: 1\n  save_strategy: 'no'\n  seed: 3\n"))
    result = run_cli("launch" if processes > 1 else "train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / name
    kls = [r["kl"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "loss" in r]
    return {"final": load_file(run / "final" / "model.safetensors"),
            "init": load_file(run / "init-model" / "model.safetensors"), "kl": kls}


def _worst_difference(run: dict, reference: dict) -> float:
    worst = 0.0
    for name, ref in reference["final"].items():
        assert torch.equal(run["init"][name], reference["init"][name])
        worst = max(worst, ((run["final"][name] - ref).norm() / ref.norm()).item())
    return worst


@pytest.mark.slow
def test_data_parallel_matches_one_big_batch(write, tmp_path):
    """apo_zero_unpaired (no KL term: a per-row loss, its mean over the batch): one batch
    in micro-batches ends with the weights of one big batch; its 2-process layout is
    kto's below (the same trainer's reduction across processes, plus the KL term). kto:
    the KL term is the mean over the step's batch, gathered across processes, of
    mismatched pairs taken within each per-device batch; with one prompt for every row
    those pairs are the same set in every layout, so 2 processes match one process;
    accumulation does not gather it (a KL estimate per micro-batch), as in TRL, so it is
    not compared for kto."""
    rows = unpaired_rows(4)
    train = jsonl(tmp_path / "u.jsonl", rows)
    runs = {layout: _parallel(layout, train, "apo_zero_unpaired", write, tmp_path)
            for layout in ("single-1x4", "accum-1x2x2")}
    for layout, run in runs.items():
        worst = _worst_difference(run, runs["single-1x4"])
        print(f"apo_zero_unpaired {layout}: weights rel. diff {worst:.2e}")
        assert worst <= 1e-5, (layout, worst)
    moved = runs["single-1x4"]
    assert any(not torch.equal(moved["final"][n], moved["init"][n]) for n in moved["final"])

    # All desirable, one prompt: training raises every completion, so the KL estimate
    # (policy over reference on the mismatched pairs) is above 0 and takes part.
    same = jsonl(tmp_path / "same.jsonl", [{**r, "prompt": rows[0]["prompt"], "label": True}
                                            for r in rows])
    kto = {layout: _parallel(layout, same, "kto", write, tmp_path)
           for layout in ("ddp-2x2", "single-1x4")}
    assert max(kto["single-1x4"]["kl"]) > 0, kto["single-1x4"]["kl"]
    worst = _worst_difference(kto["ddp-2x2"], kto["single-1x4"])
    print(f"kto ddp-2x2: weights rel. diff {worst:.2e}, kl {kto['ddp-2x2']['kl']} vs "
          f"{kto['single-1x4']['kl']}")
    assert worst <= 1e-5, worst
    assert kto["ddp-2x2"]["kl"] == pytest.approx(kto["single-1x4"]["kl"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_data_command_shows_unpaired_rows(write, tmp_path):
    result = run_cli("data", str(write("k.yaml", experiment())), "-n", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "method kto, data format unpaired_preference" in result.stdout
    assert "preference pair(s) read as unpaired rows" in result.stdout
    assert "data.train: 96 rows" in result.stdout and "data.eval: 32 rows" in result.stdout
    assert "(chosen) (" in result.stdout or "(rejected) (" in result.stdout
