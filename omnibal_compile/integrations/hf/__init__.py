"""Hugging Face: example inputs per VLM family, packing collators, a balanced-batch Trainer."""
