"""FSD inside vLLM on fsd-ext's default pair (docs/engines.md): two requests in one batch, one
verified by FSD, one exactly (threshold 0). In a venv made by scripts/setup_vllm.sh:

    python examples/vllm_fsd.py
"""

import os

# vLLM's CPU backend reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE GiB); its default does
# not fit beside the two models on a 24 GB machine. 2 GiB holds 2048-token requests for both.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import fsd_ext.models  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    # vLLM loads Hugging Face folders: resolve() converts a built-in name once (into
    # ~/.cache/fsd_ext) and returns the folder.
    target = fsd_ext.models.resolve("qwen2.5-coder-1.5b")
    draft = fsd_ext.models.resolve("qwen2.5-coder-0.5b")
    llm = LLM(model=target, dtype="bfloat16", max_model_len=2048,
              enforce_eager=True,  # on a CPU, compiling the model first takes minutes
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 5,
                                  "draft_sample_method": "probabilistic"},  # FSD needs the draft's distributions
              additional_config={"fsd": {"rule": "fsd", "divergence": "js", "threshold": 0.3}})
    prompt = "def quicksort(values):\n"
    fsd = SamplingParams(temperature=0, max_tokens=64)  # the engine's rule and threshold
    exact = SamplingParams(temperature=0, max_tokens=64, extra_args={"fsd_threshold": 0.0})  # exact SD
    for label, out in zip(("FSD, js 0.3", "SD"), llm.generate([prompt, prompt], [fsd, exact])):
        print(f"--- {label}:\n{prompt}{out.outputs[0].text}")


if __name__ == "__main__":  # vLLM starts its engine in a new process, which imports this file again
    main()
