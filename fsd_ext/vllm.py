"""fsd_ext.vllm, the import path (and vLLM's entry point, `fsd_ext.vllm:register`) of the vLLM
plug-in in fsd_ext/engines/vllm.py."""

from .engines.vllm import SUPPORTED_VLLM, TESTED_VLLM, FsdConfig, register, stats  # noqa: F401
