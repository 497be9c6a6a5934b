"""What every rank builds from the experiment: device and precision, tokenizer, model,
adapters and data. Imports torch; never imported by the CLI's light paths."""
