"""One training run, as every rank runs it: check how the process was launched
(launched.py, torch-free), build tokenizer, data, model and trainer (build.py), train with
finetune's callbacks (callbacks.py) and signal handling (preemption.py), evaluate before
and after (evaluation.py), save and report (worker.py). Imports the building blocks
(config, data, model, methods, trainers, rundir, report, hub, render's precision table);
never launch or inference."""
