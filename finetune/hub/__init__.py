"""Sharing a run on the Hugging Face Hub: `finetune push` and the upload after training
(upload.py), the model card (modelcard.py). Torch-free; imports config, report and errors."""
