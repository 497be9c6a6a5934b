"""Using a run's model after training: load it (load.py), merge an adapter into its base
(merge.py), generate from prompts (generate.py), chat in the terminal (chat.py). The
subcommands are registered by commands.py, which imports none of the rest until run."""
