"""FSD inside other engines (docs/engines.md):

    hf.py     Hugging Face transformers: `model.generate(custom_generate=fsd_ext.hf.generate)`
              runs fsd-ext's decoding loop (hf_custom_generate/: the same as a folder)
    vllm.py   vLLM: a plug-in that verifies vLLM's draft-model speculation with fsd_ext.accept

fsd_ext.hf and fsd_ext.vllm stay their import paths (and vLLM's entry point).
"""
