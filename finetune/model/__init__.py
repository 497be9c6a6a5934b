"""The model: loading it pretrained or from a random init (load.py), LoRA/QLoRA (peft.py),
the tokenizer and chat template (tokenizer.py), the finetune_varlen attention
(varlen.py), reward models and functions (rewards.py), device, precision and kernels
resolved on this machine (hardware.py), and a saved run's model, final/, a checkpoint or
a merge (saved.py: what generate, chat, merge and a distillation teacher load). Imports
config, estimate, rundir and errors."""
