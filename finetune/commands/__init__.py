"""The subcommands that are no other package's own, their parsers and their work:
`finetune data` (data.py, torch-free; data_view.py), `finetune env` (machine.py),
`finetune eval` (eval.py, torch-free; eval_saved.py builds the trainer and loads the
weights), and the argparse pieces every parser shares (args.py). The top layer: it may
import any package; nothing imports it but cli.py and the packages' own parsers (args.py)."""
