"""The model card (README.md) a run is shared with: base model, data, method, settings and
the metrics before and after training. Built from the run's files alone (the resolved
experiment and summary.json, as plain data), so `finetune push` can build it for any
finished run. Torch-free; no secret (training.hub_token) and no local path enters it:
local files are named by their file name only."""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any

import yaml

from finetune import __version__
from finetune.config.derived.effective import HUB_KEYS
from finetune.config.methods import method
from finetune.config.rules import HUB_ID
from finetune.config.secrets import is_secret
from finetune.report.summary import summary_metrics

# The settings every card shows, as the run had them (training_args.json), defaults too.
KEY_ARGS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "optim",
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs",
            "max_steps", "max_length", "seed")
_PEFT_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
# Not settings of the model: where and whether it is uploaded.
_NOT_SETTINGS = ("push_to_hub", *HUB_KEYS)
# Measurements of the run itself, not of the model (as the end summary leaves them out).
_NOT_RESULTS = ("runtime", "per_second", "preparation_time", "num_tokens", "epoch", "entropy")


def hub_id(path: str | None) -> str | None:
    """`path` if it names a hub repository, not a local file or directory."""
    if not path or path.startswith(("/", ".", "~")) or os.path.exists(path):
        return None
    return path if HUB_ID.fullmatch(path) else None


def _source(path: str) -> str:
    found = hub_id(path)
    return f"[{found}](https://huggingface.co/datasets/{found})" if found \
        else f"a local file, `{PurePath(path).name}`"


def _metadata(exp: dict[str, Any], adapter: bool) -> dict[str, Any]:
    record = method(exp["method"])
    data = [s["path"] for split in ("train", "eval") for s in exp["data"].get(split) or []]
    base = hub_id(exp["model"]["name_or_path"]) if exp["model"]["init"] == "pretrained" else None
    meta: dict[str, Any] = {}
    if base:
        meta["base_model"] = base
    datasets = sorted({d for d in map(hub_id, data) if d})
    if datasets:
        meta["datasets"] = datasets
    meta["library_name"] = "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "text-generation" if record.head == "lm" else "text-classification"
    meta["tags"] = ["finetune", exp["method"]] + ([exp["peft"]["type"]] if adapter else [])
    return meta


def _origin(exp: dict[str, Any], adapter: bool) -> str:
    model = exp["model"]
    found = hub_id(model["name_or_path"])
    named = f"[{found}](https://huggingface.co/{found})" if found \
        else f"a local model, `{PurePath(model['name_or_path']).name}`"
    what = f"A {_PEFT_NAMES.get(exp['peft']['type'], exp['peft']['type'])} adapter" if adapter \
        else "A model"
    if model["init"] == "random":
        return f"{what} trained with finetune's `{exp['method']}` method from randomly " \
               f"initialised weights of the architecture of {named}."
    return f"{what} fine-tuned from {named} with finetune's `{exp['method']}` method."


def _results(summary: dict[str, Any]) -> list[str]:
    before, after = summary.get("before") or {}, summary.get("after") or {}
    keys = [k for k in sorted(set(before) | set(after))
            if not any(word in k for word in _NOT_RESULTS)
            and any(isinstance(part.get(k), (int, float)) for part in (before, after))]
    if not keys:
        return ["No held-out evaluation was run (data.eval or data.eval_fraction)."]

    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, (int, float)) else "-"

    rows = ["| metric | before training | after training |", "|---|---|---|"]
    rows += [f"| {k} | {cell(before.get(k))} | {cell(after.get(k))} |" for k in keys]
    if not before:
        rows.append("\n(The evaluation before training was not run, or ran in an earlier "
                    "attempt of a resumed run.)")
    return rows


def _settings(exp: dict[str, Any], adapter: bool, ran: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {"method": exp["method"],
                                "precision": ran.get("precision") or exp["precision"]}
    if adapter:
        peft = exp["peft"]
        keys = ["type", "r", "alpha", "dropout", "target_modules", "use_rslora", "use_dora"]
        if peft["type"] == "qlora":
            keys += ["bits", "quant_type", "double_quant"]
        settings["peft"] = {k: peft[k] for k in keys if k in peft}
    args = ran.get("training_args") or {}
    training = {k: args[k] for k in KEY_ARGS if k in args}
    training.update((k, v) for k, v in (exp.get("training") or {}).items()
                    if not is_secret(str(k)) and k not in _NOT_SETTINGS)
    settings["training"] = training
    processes = (exp.get("distributed") or {}).get("num_processes")
    if processes:
        settings["processes"] = processes
    return settings


def _usage(repo_id: str, head: str, adapter: bool) -> str:
    kind = "CausalLM" if head == "lm" else "SequenceClassification"
    auto = f"AutoPeftModelFor{kind}" if adapter else f"AutoModelFor{kind}"
    return "\n".join(["```python", f"from {'peft' if adapter else 'transformers'} import {auto}",
                      "from transformers import AutoTokenizer", "",
                      f'model = {auto}.from_pretrained("{repo_id}")',
                      f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```"])


def model_card(exp: dict[str, Any], summary: dict[str, Any], repo_id: str,
               ran: dict[str, Any] | None = None) -> str:
    """README.md for the final model of a run. exp: the resolved experiment as data
    (experiment.yaml); summary: summary.json; ran: what the run resolved, where known
    (precision: environment.json's; training_args: training_args.json)."""
    adapter = exp["peft"]["type"] != "none"
    record = method(exp["method"])
    numbers = summary_metrics(summary)
    train_loss = numbers.get("train/train_loss")
    data = exp["data"]
    lines = ["---", yaml.safe_dump(_metadata(exp, adapter), sort_keys=False).rstrip(), "---",
             "", f"# {repo_id.split('/')[-1]}", "", _origin(exp, adapter), "",
             "## Training data", ""]
    lines += [f"- train: {_source(s['path'])}" + (f" (split {s['split']})" if s.get("split")
                                                  and hub_id(s["path"]) else "")
              for s in data.get("train") or []]
    lines += [f"- eval: {_source(s['path'])}" for s in data.get("eval") or []]
    if data.get("eval_fraction"):
        lines.append(f"- eval: {data['eval_fraction']:g} of the training rows, held out")
    lines += ["", "## Results", "", *_results(summary), "",
              "## Training", "",
              f"{summary.get('global_step', '?')} optimizer steps in "
              f"{summary.get('seconds', '?')} s" +
              (f", final training loss {train_loss:.4g}." if train_loss is not None else "."),
              "", "```yaml", yaml.safe_dump(_settings(exp, adapter, ran or {}), sort_keys=False).rstrip(),
              "```", "", "## Use", "", _usage(repo_id, record.head, adapter), "",
              f"Trained and shared with finetune {__version__}."]
    return "\n".join(lines) + "\n"
