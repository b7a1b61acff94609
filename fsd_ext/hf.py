"""fsd_ext.hf, the import path of the Hugging Face integration in fsd_ext/engines/hf.py."""

from .engines.hf import CUSTOM_GENERATE_DIR, generate, generate_from_raw_arguments  # noqa: F401
