"""Reading the experiment's data as training will: local files and hub datasets (load.py,
files.py: their bytes, checked), row checks (rows.py, formats.py: the public schemas),
validate's row-by-row pass (scan.py) and its warnings of data too small (sizes.py),
mixtures (mix.py), streaming (stream.py), sft tokenization (sft_tokens.py), prompts for
the generating methods (prompts.py), and the prepared-data cache shared by the ranks
(prepare.py, parallel.py). Imports config, fileio, errors, and model/ for the
tokenizer's chat template."""
