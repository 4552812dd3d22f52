"""Tests of the Hugging Face helpers (``vivit/huggingface.py``) and models."""
