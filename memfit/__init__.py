"""memfit: make LLM training, fine-tuning and inference fit the GPU memory you have."""
__version__ = "0.1.0"
