"""`finetune sweep EXPERIMENT SWEEP`: a hyperparameter search whose trials are ordinary run
directories (spec.py: the sweep file; search.py: which parameters each trial takes;
runner.py: running, stopping and resuming trials; results.py: the table and plot).
Torch-free: every trial is a `finetune train` (or `launch`) subprocess."""
