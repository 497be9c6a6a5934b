"""The quickstart sft on CUDA with `model.attn_implementation=auto`, and what a user does
with the run afterwards (docs/after-training.md): `finetune generate` and `finetune eval`
on CUDA. One run, trained once for the module."""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from test_eval import model_metrics

from .helpers import CUDA, SFT, finetune, observed, read_json

# Half the quickstart's 300 steps: 0 -> 1.00 held-out exact match on the CPU (fp32, seed 0;
# 60 steps give 0.07, 100 give 0.89); warm-up a tenth of the steps, as the quickstart.
STEPS = 150
EVAL_ROWS = len((DATA / "sft_eval.jsonl").read_text().splitlines())  # 200


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("sft")
    run = cwd / "run"
    result = finetune("train", SFT, CUDA, "model.attn_implementation=auto",
                      f"training.max_steps={STEPS}", f"training.warmup_steps={STEPS // 10}",
                      "training.save_steps=1000", f"output.dir={run}", cwd=cwd, timeout=300)
    return cwd, run, result.stdout


def test_sft_learns_on_cuda_with_the_attention_auto_chose(sft_run, gpu, figures):
    """exact match rises; environment.json names the attention auto resolved to: on an
    Ampere or newer GPU flash-attention 2 where flash_attn imports, else finetune_varlen
    (torch's own varlen kernel), both without a dense mask; and the precision, bf16."""
    cwd, run, stdout = sft_run
    summary = read_json(run / "summary.json")
    environment = read_json(run / "environment.json")
    before, after = summary["before"]["eval_exact_match"], summary["after"]["eval_exact_match"]
    figures(exact_match=[before, after], seconds=summary["seconds"], steps=STEPS,
            attention=environment["attention"], precision=environment["precision"])
    assert summary["global_step"] == STEPS
    assert before <= 0.05 and after >= 0.5, (before, after)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] / 2
    assert environment["device"] == "cuda" and environment["gpus"]
    if tuple(gpu["capability"]) >= (8, 0):
        assert gpu["varlen_attn"] or gpu["flash_attn"], "torch without varlen_attn (>= 2.11)"
        expected = "flash_attention_2" if gpu["flash_attn"] else "finetune_varlen"
        assert environment["attention"] == expected
        assert environment["precision"] == "bf16"
        assert f"attention {expected}" in stdout  # the start summary's speed line
        args = read_json(run / "training_args.json")
        assert args["bf16"] is True and args["padding_free"] is True


def test_generate_on_cuda_writes_one_row_per_prompt(sft_run, figures):
    """`finetune generate RUN --file` on CUDA (its process allocated CUDA memory): one JSON
    row per prompt, and greedy answers that reproduce the run's own exact match. Not to
    the prompt: generate runs bf16 weights, training evaluated fp32 weights under bf16
    autocast, so a few near-tie answers may differ."""
    cwd, run, _ = sft_run
    out = cwd / "answers.jsonl"
    _, record = observed("generate", run, "--file", DATA / "sft_eval.jsonl", "--out", out,
                         "--max-new-tokens", 12, "--batch-size", 100, cwd=cwd, timeout=180)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    hits = sum(r["completion"].strip() == r["reference"].strip() for r in rows) / len(rows)
    reported = read_json(run / "summary.json")["after"]["eval_exact_match"]
    figures(rows=len(rows), exact_match=hits, training_reported=reported,
            max_memory_allocated=record["max_memory_allocated"])
    assert record["max_memory_allocated"] > 0  # the model ran on the GPU
    assert len(rows) == EVAL_ROWS
    assert all(set(r) >= {"prompt", "completion", "reference"} for r in rows)
    assert rows[0]["prompt"] == [{"role": "user", "content": "sort: dog cat sun apple"}]
    assert hits == pytest.approx(reported, abs=0.1)


def test_eval_on_cuda_scores_what_training_reported(sft_run, figures):
    """`finetune eval RUN` on CUDA: the metrics training reported after training
    (summary.json), as tests/test_eval.py holds them on the CPU (to 1e-6 there). Here to
    1e-4: another process may pick other CUDA kernels for the same shapes; exact match to
    one prompt in 200."""
    cwd, run, _ = sft_run
    result, record = observed("eval", run, cwd=cwd, timeout=180)
    written = result.stdout.strip().splitlines()[-1].removeprefix("  written to ")
    evaluated = json.loads(open(written).read())
    reported = model_metrics(read_json(run / "summary.json")["after"])
    metrics = model_metrics(evaluated["metrics"])
    figures(eval_loss=[reported["eval_loss"], metrics["eval_loss"]],
            exact_match=[reported["eval_exact_match"], metrics["eval_exact_match"]])
    assert record["max_memory_allocated"] > 0
    trained = read_json(run / "environment.json")
    assert (evaluated["device"], evaluated["precision"]) == ("cuda", trained["precision"])
    assert evaluated["model"] == str(run / "final") and evaluated["rows"] == EVAL_ROWS
    assert reported and set(metrics) == set(reported)
    for key, value in reported.items():
        tolerance = dict(abs=1 / EVAL_ROWS + 1e-9) if key == "eval_exact_match" else \
            dict(rel=1e-4, abs=1e-6)
        assert metrics[key] == pytest.approx(value, **tolerance), key
