"""Using a run's model after training: merge an adapter into its base (merge.py), generate
from prompts (generate.py, best_of_n.py, reward_sources.py: --best-of), chat in the
terminal (chat.py). The subcommands are registered by cli.py, torch-free, which imports
none of the rest until a command runs. Imports model, trainers, config and errors."""
