"""Fixtures of the vLLM backend tests (helpers: ``vllm_helpers.py``)."""

from vllm_helpers import model_dirs  # noqa: F401
