"""Using a run's model after training: final/ loads on its own with the transformers and
PEFT auto classes (in a fresh process, from another working directory, after the run
directory is moved), `finetune merge`, `finetune generate` and `finetune chat` (in a real
terminal, through tmux). The runs are the quickstart's, trained for a few steps.

"What the run produced" is read from the run itself: the greedy answers its evaluation
recorded (metrics.jsonl), its eval accuracy (summary.json), and its weights on disk, put
together here by hand (base + scale x B @ A) as an independent reference for the logits.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA, QUICKSTART, REPO, run_cli

# One worker runs this module: its module fixtures (the trained runs) train once, not once
# per worker.
pytestmark = pytest.mark.xdist_group("inference")

IDS = [[1, 5, 9, 17, 40, 101, 7, 3]]  # token ids for a logits comparison (vocab 349)

# Loads a model directory with an auto class in a fresh process and prints its logits on
# IDS, its greedy answers to the prompts given (rendered text), and, for a sequence
# classifier, its predicted labels for texts.
LOAD = r"""
import json, sys, torch, transformers, peft

directory, name, task = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
auto = getattr(peft if name.startswith("AutoPeft") else transformers, name)
model = auto.from_pretrained(directory).eval()
out = {"class": type(model).__name__}
with torch.no_grad():
    out["logits"] = model(torch.tensor(task["ids"])).logits.tolist()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    out["generated"] = []
    for prompt in task.get("prompts", []):
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        out["generated"].append(tok.decode(ids[0, enc["input_ids"].shape[1]:],
                                           skip_special_tokens=True).strip())
    out["labels"] = []
    for text in task.get("texts", []):
        enc = tok(text, truncation=True, max_length=task["max_length"], return_tensors="pt")
        index = int(model(**enc).logits[0].argmax())
        out["labels"].append(model.config.id2label[index])
    out["scores"] = []
    for ids in task.get("pairs", []):
        out["scores"].append([float(model(torch.tensor([i])).logits[0, 0]) for i in ids])
print(json.dumps(out))
"""


def load_elsewhere(directory: Path, auto_class: str, cwd: Path, **task) -> dict:
    """The LOAD script in a fresh interpreter, run from `cwd` (not the run directory)."""
    task.setdefault("ids", IDS)
    result = subprocess.run([sys.executable, "-c", LOAD, str(directory), auto_class,
                             json.dumps(task)], cwd=cwd, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def reconstructed(base: Path, adapter: Path | None, head: str = "lm"):
    """The model from the files alone: the base's safetensors, plus alpha/r x B @ A for
    every adapted weight and the adapter's full modules (a score head)."""
    import torch
    from safetensors.torch import load_file
    from transformers import (AutoConfig, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    model = cls.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
    state = load_file(str(base / "model.safetensors"))
    if adapter is not None:
        spec = json.loads((adapter / "adapter_config.json").read_text())
        scale = spec["lora_alpha"] / spec["r"]
        lora = load_file(str(adapter / "adapter_model.safetensors"))
        for key, value in lora.items():
            name = key.removeprefix("base_model.model.")
            if ".lora_A." in key:
                target = name.replace(".lora_A.weight", ".weight")
                state[target] = state[target] + scale * lora[key.replace("lora_A", "lora_B")] @ value
            elif ".lora_B." not in key:
                state[name] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def reference_logits(model) -> list:
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.tolist()


def assert_close(a, b, tolerance: float) -> None:
    import torch

    difference = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
    assert difference <= tolerance, difference


def train(root: Path, config: Path, *overrides: str) -> Path:
    run = root / "run"
    result = run_cli("train", str(config), f"output.dir={run}", "training.save_steps=10",
                     *overrides, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def recorded_answers(run: Path) -> list[dict]:
    """The greedy answers the run's evaluation after training wrote (sft exact match)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("when") == "after")["exact_match_examples"]


SFT = QUICKSTART / "sft.yaml"
FAST = ("training.warmup_steps=5",)


@pytest.fixture(scope="module")
def full_sft(tmp_path_factory):
    return train(tmp_path_factory.mktemp("full"), SFT, "training.max_steps=60", *FAST)


@pytest.fixture(scope="module")
def lora_sft(tmp_path_factory, full_sft):
    """LoRA on a pretrained local base (the full run's final model)."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    shutil.copytree(full_sft / "final", base)
    return train(root, SFT, f"model.name_or_path={base}", "model.init=pretrained",
                 "peft.type=lora", "training.max_steps=20", *FAST)


@pytest.fixture(scope="module")
def random_lora(tmp_path_factory):
    """A random-init LoRA run, trained in one place and then moved: the original path is
    returned too (the adapter's record names it)."""
    root = tmp_path_factory.mktemp("random-lora")
    trained = train(root, SFT, "peft.type=lora", "training.max_steps=40",
                    "training.learning_rate=3e-3", *FAST)
    moved = root / "moved" / "elsewhere"
    moved.parent.mkdir()
    trained.rename(moved)
    return moved, trained


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora", "random-lora"])
def test_final_loads_on_its_own_and_answers_as_the_run_did(kind, full_sft, lora_sft,
                                                           random_lora, tmp_path):
    run = {"full": full_sft, "lora": lora_sft, "random-lora": random_lora[0]}[kind]
    final = run / "final"
    answers = recorded_answers(run)
    loaded = load_elsewhere(final, "AutoModelForCausalLM", tmp_path,
                            prompts=[a["prompt"] for a in answers])
    assert loaded["generated"] == [a["generated"] for a in answers]
    if kind == "full":
        reference = reconstructed(final, None)
    else:
        base = run / "init-model" if kind == "random-lora" else run.parent / "base"
        reference = reconstructed(base, final)
        assert loaded["class"] == "LlamaForCausalLM"
    assert_close(loaded["logits"], reference_logits(reference), 1e-5)
    if kind == "lora":  # the adapter names its base: PEFT's own auto class loads it
        peft = load_elsewhere(final, "AutoPeftModelForCausalLM", tmp_path)
        assert peft["class"] == "PeftModelForCausalLM"
        assert_close(peft["logits"], loaded["logits"], 1e-6)


@pytest.mark.slow
def test_a_random_init_adapter_names_init_model_and_carries_its_base(random_lora, tmp_path):
    moved, trained = random_lora
    final = moved / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(trained / "init-model")
    # The base's files sit next to the adapter, hard-linked to init-model/'s.
    for name in ("config.json", "model.safetensors"):
        assert (final / name).stat().st_ino == (moved / "init-model" / name).stat().st_ino
    # Moved, AutoModelForCausalLM loaded it above; PEFT's AutoPeftModel loads the base at
    # the recorded path, so it loads where the run was trained.
    trained.parent.mkdir(parents=True, exist_ok=True)
    moved.rename(trained)
    try:
        peft = load_elsewhere(trained / "final", "AutoPeftModelForCausalLM", tmp_path)
        plain = load_elsewhere(trained / "final", "AutoModelForCausalLM", tmp_path)
    finally:
        trained.rename(moved)
    assert peft["class"] == "PeftModelForCausalLM"
    assert_close(peft["logits"], plain["logits"], 1e-6)


@pytest.fixture(scope="module")
def classify_lora(tmp_path_factory):
    return train(tmp_path_factory.mktemp("classify"), QUICKSTART / "classify.yaml",
                 "peft.type=lora", "training.max_steps=20")


@pytest.fixture(scope="module")
def reward_full(tmp_path_factory):
    return train(tmp_path_factory.mktemp("reward"), QUICKSTART / "reward.yaml",
                 "training.max_steps=10", "training.warmup_steps=2")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_classify_and_reward_finals_load_as_sequence_classifiers(classify_lora, reward_full,
                                                                  tmp_path):
    # classify (random-init LoRA): the loaded model's labels give the run's eval accuracy.
    rows = read_jsonl(DATA / "classify_eval.jsonl")
    loaded = load_elsewhere(classify_lora / "final", "AutoModelForSequenceClassification",
                            tmp_path, texts=[r["text"] for r in rows], max_length=16)
    accuracy = sum(p == r["label"] for p, r in zip(loaded["labels"], rows)) / len(rows)
    summary = json.loads((classify_lora / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["after"]["eval_accuracy"], abs=1e-9)
    reference = reconstructed(classify_lora / "init-model", classify_lora / "final", "score")
    assert_close(loaded["logits"], reference_logits(reference), 1e-5)

    # reward (full): its scores rank the eval pairs as the run's accuracy says.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_full / "final")
    pairs = [[list(tokenizer.apply_chat_template(r["prompt"] + r[answer], tokenize=True,
                                                 return_dict=True)["input_ids"])
              for answer in ("chosen", "rejected")]
             for r in read_jsonl(DATA / "pref_eval.jsonl")]
    loaded = load_elsewhere(reward_full / "final", "AutoModelForSequenceClassification",
                            tmp_path, pairs=pairs)
    accuracy = sum(c > r for c, r in loaded["scores"]) / len(pairs)
    summary = json.loads((reward_full / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["after"]["eval_accuracy"], abs=1e-6)  # float32


def finetune(*args, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(*map(str, args), cwd=cwd)


@pytest.mark.slow
def test_merge_writes_a_sharded_full_model_equal_to_base_plus_adapter(lora_sft, tmp_path):
    out = tmp_path / "merged"
    result = finetune("merge", lora_sft, "--out", out, "--max-shard-size", "1MB", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"finetune: merged model in {out}" in result.stdout
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert not (out / "adapter_config.json").exists()
    merged = load_elsewhere(out, "AutoModelForCausalLM", tmp_path,
                            prompts=[a["prompt"] for a in recorded_answers(lora_sft)])
    adapted = load_elsewhere(lora_sft / "final", "AutoPeftModelForCausalLM", tmp_path)
    assert_close(merged["logits"], adapted["logits"], 1e-5)
    assert merged["generated"] == [a["generated"] for a in recorded_answers(lora_sft)]

    # A non-empty --out is refused and left as it was; --force replaces it.
    index = (out / "model.safetensors.index.json").read_text()
    again = finetune("merge", lora_sft, "--out", out, "--checkpoint", "checkpoint-10",
                     "--dtype", "bf16", cwd=tmp_path)
    assert again.returncode == 2 and "is not empty; nothing was written" in again.stderr
    assert (out / "model.safetensors.index.json").read_text() == index
    forced = finetune("merge", lora_sft, "--out", out, "--checkpoint", "checkpoint-10",
                      "--dtype", "bf16", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert not (out / "model.safetensors.index.json").exists()  # one 5GB shard now
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {__import__("torch").bfloat16}
    at_10 = reconstructed(lora_sft.parent / "base", lora_sft / "checkpoints" / "checkpoint-10")
    merged_10 = load_elsewhere(out, "AutoModelForCausalLM", tmp_path)
    assert_close(merged_10["logits"], reference_logits(at_10), 0.1)  # bf16 weights


@pytest.mark.slow
def test_merge_of_random_init_and_classify_runs_and_what_is_refused(random_lora, classify_lora,
                                                                    full_sft, tmp_path):
    run = random_lora[0]  # moved: the base is found as the run's own init-model/
    result = finetune("merge", run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = load_elsewhere(run / "merged", "AutoModelForCausalLM", tmp_path)
    reference = reconstructed(run / "init-model", run / "final")
    assert_close(merged["logits"], reference_logits(reference), 1e-5)

    result = finetune("merge", classify_lora, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = load_elsewhere(classify_lora / "merged", "AutoModelForSequenceClassification",
                            tmp_path)
    reference = reconstructed(classify_lora / "init-model", classify_lora / "final", "score")
    assert_close(merged["logits"], reference_logits(reference), 1e-5)

    refused = finetune("merge", full_sft, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"error: {full_sft} is a full fine-tuning run (peft.type none): nothing to merge; " \
           f"{full_sft / 'final'} is already a full model" in refused.stderr
    assert not (full_sft / "merged").exists()
    missing = finetune("merge", run, "--checkpoint", "checkpoint-999", cwd=tmp_path)
    assert missing.returncode == 2 and "checkpoint-999: no such directory" in missing.stderr
    not_run = finetune("merge", tmp_path, cwd=tmp_path)
    assert not_run.returncode == 2 and "is not a finetune run directory" in not_run.stderr
    bad_size = finetune("merge", run, "--max-shard-size", "5 gigs", cwd=tmp_path)
    assert bad_size.returncode == 2 and "expected a size like 5GB" in bad_size.stderr


@pytest.mark.slow
def test_merge_of_a_qlora_run_uses_the_unquantized_base(tmp_path):
    run = train(tmp_path, SFT, "peft.type=qlora", "training.max_steps=5")
    result = finetune("merge", run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = load_elsewhere(run / "merged", "AutoModelForCausalLM", tmp_path)
    reference = reconstructed(run / "init-model", run / "final")
    assert_close(merged["logits"], reference_logits(reference), 1e-5)


@pytest.mark.slow
def test_generate_gives_the_runs_own_answers(full_sft, random_lora, tmp_path):
    out = tmp_path / "answers.jsonl"
    result = finetune("generate", full_sft, "--file", DATA / "sft_eval.jsonl", "--out", out,
                      "--max-new-tokens", 12, "--batch-size", 32, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out)
    summary = json.loads((full_sft / "summary.json").read_text())
    hits = sum(r["completion"].strip() == r["reference"].strip() for r in rows) / len(rows)
    assert len(rows) == 200 and hits == pytest.approx(summary["after"]["eval_exact_match"])
    answers = recorded_answers(full_sft)
    assert [r["completion"].strip() for r in rows[:3]] == [a["generated"] for a in answers]
    assert rows[0]["prompt"] == [{"role": "user", "content": "sort: dog cat sun apple"}]

    again = finetune("generate", full_sft, "--prompt", "x", "--out", out, cwd=tmp_path)
    assert again.returncode == 2 and "exists; nothing was written" in again.stderr
    assert len(read_jsonl(out)) == 200

    # --prompt is a user turn of the chat template; --raw sends the text as it is.
    first = answers[0]
    user = first["prompt"].split("<|user|>")[1].split("<|end|>")[0]
    chat = finetune("generate", full_sft, "--prompt", user, "--max-new-tokens", 12,
                    cwd=tmp_path)
    raw = finetune("generate", full_sft, "--raw", "--prompt", first["prompt"],
                   "--max-new-tokens", 12, cwd=tmp_path)
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr[-3000:] + raw.stderr
    assert json.loads(chat.stdout)["completion"].strip() == first["generated"] == \
        json.loads(raw.stdout)["completion"].strip()

    # An adapter run moved elsewhere: its base is the run's init-model/.
    run = random_lora[0]
    result = finetune("generate", run, "--prompt", user, "--max-new-tokens", 12, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["completion"].strip() == \
        recorded_answers(run)[0]["generated"]


@pytest.mark.slow
def test_generate_refuses_a_classifier_and_names_bad_rows(classify_lora, full_sft, tmp_path):
    refused = finetune("generate", classify_lora, "--prompt", "cat", cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"error: {classify_lora} is a classify run: its model scores text" in refused.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n\n{"prompt": "ok", "messages": []}\n')
    bad = finetune("generate", full_sft, "--file", prompts, cwd=tmp_path)
    assert bad.returncode == 2
    assert f"error: {prompts} line 3: a row needs exactly one of 'prompt'" in bad.stderr
    neither = finetune("generate", full_sft, cwd=tmp_path)
    assert neither.returncode == 2 and "one of the arguments --prompt --file" in neither.stderr


@pytest.mark.parametrize("line,problem", [
    ("[1, 2]", "a row must be a JSON object, not list"),
    ('{"prompt": 3}', "prompt is not a non-empty list of messages"),
    ('{"messages": [{"role": "user"}]}', "messages has a message \\(0\\) that is not"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "messages is one assistant turn"),
    ("{not json", "not a JSON object"),
])
def test_prompt_rows_are_checked_by_file_and_line(line, problem, tmp_path):
    from finetune.errors import DataError
    from finetune.inference.prompts import from_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))} line 2: {problem}"):
        from_file(str(path))


def test_prompt_rows_keep_their_reference():
    from finetune.inference.prompts import _row

    chat = _row({"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a"}]}, "f line 1")
    assert chat.messages == [{"role": "user", "content": "q"}] and chat.reference == "a"
    text = _row({"prompt": "q", "completion": "a"}, "f line 2")
    assert (text.text, text.reference, text.messages) == ("q", "a", None)


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for(session: str, text: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        screen = tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session)
        if text in screen:
            return screen
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never appeared:\n{screen}")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_chat_in_a_terminal(full_sft, tmp_path):
    refused = run_cli("chat", str(full_sft), "--image", "pic.png", cwd=tmp_path)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"--image: {full_sft / 'final'} is not a vision-language model" in refused.stderr
    answers = recorded_answers(full_sft)
    users = [a["prompt"].split("<|user|>")[1].split("<|end|>")[0] for a in answers]
    session = f"finetune-chat-{tmp_path.name}"
    status = tmp_path / "status"
    command = (f"cd {tmp_path} && PYTHONPATH={REPO} {sys.executable} -m finetune chat "
               f"{full_sft} --max-new-tokens 12; echo $? > {status}; sleep 60")
    tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "40", command)
    try:
        wait_for(session, "you> ")
        tmux("send-keys", "-t", session, users[0], "Enter")
        wait_for(session, f"assistant>  {answers[0]['generated']}\nyou> ")
        # /reset: the next answer is the one to a fresh conversation, as the run's was.
        tmux("send-keys", "-t", session, "/reset", "Enter")
        wait_for(session, "finetune: conversation reset")
        tmux("send-keys", "-t", session, users[1], "Enter")
        wait_for(session, f"assistant>  {answers[1]['generated']}\nyou> ")
        tmux("send-keys", "-t", session, "/help", "Enter")
        wait_for(session, "commands: /reset starts again")
        tmux("send-keys", "-t", session, "/image pic.png", "Enter")  # one line, chat goes on
        wait_for(session, "finetune: /image: the model takes text only")
        tmux("send-keys", "-t", session, "C-d")
        screen = wait_for(session, "finetune: bye")
        deadline = time.time() + 60
        while not status.exists() and time.time() < deadline:
            time.sleep(0.3)
        assert status.read_text().strip() == "0"
        assert "Traceback" not in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
