"""`fsd-ext demo`'s decoding with the CPU linear component's kernels against what PyTorch ships for
the same weights, end to end.

--weights gguf (the default pair's default setup on an AVX-512 CPU):
    fsd   QuantWeightLinear (csrc/cpu_linear/quant_gemm.cpp), float32 activations, every weight the
          file's exact value
    torch the file's 4-bit layers (Q4_K, Q4_0, Q4_1) through aten._weight_int4pack_mm_for_cpu
          (group 32; x, scales and zeros in bfloat16: torch's vectorised path), the others (Q5_0,
          Q6_K, Q8_0) re-quantised to int8 with one scale per output row through
          aten._weight_int8pack_mm (x in bfloat16); nothing else changes
--weights gguf-int8 (int8 activations, the default pair's default on an AVX512-VNNI CPU), the decoder
layers unfused on both sides so that the products alone differ:
    fsd   QuantInt8Linear (csrc/cpu_linear/int8_gemm.cpp): the file's codes, x quantised to int8 per
          32 features
    torch torch.ao's dynamic quantized Linear (engine "x86"): the file's weights re-quantised to int8
          with one scale per output row, x quantised per call with one scale
--weights bfloat16 (a bfloat16 model, the default for other checkpoints on an AVX512-BF16 CPU):
    fsd   skinny_linear (csrc/cpu_linear/skinny_gemm.cpp) for the few-row products
    torch F.linear

Both pairs load once; the rounds alternate the two (AR, SD, FSD on the demo prompts, greedy,
K=5), and the median tokens/s per rule is reported with the ratio. Fidelity: whether greedy AR
gives the same tokens, and the largest |logit difference| of the target's prompt forward.

    python benchmarks/cpu_linear/bench_cpu_linear_e2e.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_ext import cpu_linear, models  # noqa: E402
from fsd_ext.cli import DEMO_PROMPTS, _encode  # noqa: E402
from fsd_ext.generate import generate  # noqa: E402


class TorchWeightOnlyLinear(torch.nn.Module):
    """A QuantWeightLinear's weight in torch's int4 (q4) or per-row int8 (q8, q8g32) packed form."""

    def __init__(self, layer: cpu_linear.QuantWeightLinear):
        super().__init__()
        self.out_features, self.bias = layer.out_features, layer.bias
        self.int4 = layer.format == "q4"
        if self.int4:
            blocks, groups, _ = layer.codes.shape
            by_row = layer.codes.reshape(blocks, groups, 4, 16)
            q = torch.cat([by_row & 15, by_row >> 4], dim=-1)  # [blocks, groups, 4 rows, 32]
            q = q.permute(0, 2, 1, 3).reshape(blocks * 4, groups * 32)[:self.out_features]
            scale = layer.params[..., 0::2].permute(0, 2, 1).reshape(blocks * 4, groups)[:self.out_features]
            offset = layer.params[..., 1::2].permute(0, 2, 1).reshape(blocks * 4, groups)[:self.out_features]
            # torch's int4 weight is (q - 8) * scale + zero
            zero = offset + 8 * scale
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
            self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).bfloat16().contiguous()
        else:
            w = layer.dequantized_weight()
            scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127
            self.w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scale.bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x2 = x.shape, x.reshape(-1, x.shape[-1]).bfloat16()
        if self.int4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, 32, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.w8, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def torch_dynamic_int8(layer: cpu_linear.QuantInt8Linear) -> torch.nn.Module:
    """torch.ao's dynamic quantized Linear holding `layer`'s weights as int8 with a scale per row."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    torch.backends.quantized.engine = "x86"
    w = layer.dequantized_weight()
    scales = (w.abs().amax(1).clamp_min(1e-30) / 127).double()
    module = DynamicLinear(layer.in_features, layer.out_features, dtype=torch.qint8)
    module.set_weight_bias(torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0,
                                                      torch.qint8), layer.bias)
    return module


def to_torch_ops(model: torch.nn.Module) -> int:
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, cpu_linear.QuantWeightLinear):
                setattr(module, child_name, TorchWeightOnlyLinear(child))
                swapped += 1
            elif isinstance(child, cpu_linear.QuantInt8Linear):
                setattr(module, child_name, torch_dynamic_int8(child))
                swapped += 1
    return swapped


def load_pair(backend: str, weights_kind: str):
    pair = []
    for name in (models.DEFAULT_TARGET, models.DEFAULT_DRAFT):
        if weights_kind == "bfloat16":
            model, tokenizer = models.load(name, dtype=torch.bfloat16, device="cpu", linear_weights=None,
                                           cpu_linears=backend == "fsd")
            pair.append((model, tokenizer))
            continue
        dtype, weights = models.resolve_load_options(name, "cpu", "float32", "gguf")
        activations = "int8" if weights_kind == "gguf-int8" else "float32"
        model, tokenizer = models.load(name, dtype=dtype, device="cpu", linear_weights=weights, activations=activations)
        for module in model.modules():  # (unfused: the products alone differ between the backends)
            module.__dict__.pop("forward", None)
        if backend == "torch":
            print(f"{name}: {to_torch_ops(model)} layers on torch's ops", file=sys.stderr)
        pair.append((model, tokenizer))
    return pair[0][0], pair[1][0], pair[0][1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", choices=["gguf", "gguf-int8", "bfloat16"], default="gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "results" / "bench_cpu_linear_e2e.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = {b: load_pair(b, args.weights) for b in ("fsd", "torch")}
    tokenizer = backends["fsd"][2]
    prompts = [_encode(tokenizer, p, True, "cpu") for p in DEMO_PROMPTS[:args.num_prompts]]
    rules = {"ar": {}, "sd": {}, "fsd": dict(divergence="js", threshold=0.3)}
    fidelity = {}
    with torch.no_grad():
        logits = {b: backends[b][0](prompts[0]).logits[0].float() for b in backends}
    fidelity["prompt0_max_abs_logit_diff"] = (logits["fsd"] - logits["torch"]).abs().max().item()
    fidelity["prompt0_logit_scale"] = logits["fsd"].abs().max().item()
    tps = {(b, r): [] for b in backends for r in rules}
    ar_tokens = {}
    for b, (target, draft, _) in backends.items():  # warm-up
        generate(target, draft, prompts[0], rule="sd", temperature=0.0, max_new_tokens=4)
    for round_index in range(args.rounds):
        for b in (("fsd", "torch") if round_index % 2 == 0 else ("torch", "fsd")):
            target, draft, _ = backends[b]
            for rule, kw in rules.items():
                tokens = seconds = 0.0
                for i, ids in enumerate(prompts):
                    start = time.perf_counter()
                    out = generate(target, draft if rule != "ar" else None, ids, rule=rule, temperature=0.0,
                                   num_draft_tokens=5, max_new_tokens=args.max_new_tokens, seed=0, **kw)
                    seconds += time.perf_counter() - start
                    tokens += out.stats.new_tokens
                    if rule == "ar":
                        ar_tokens[(b, i)] = out.sequences[0, ids.shape[1]:].tolist()
                tps[(b, rule)].append(tokens / seconds)
                print(f"round {round_index} {b:>5} {rule:>3}: {tokens / seconds:.2f} tokens/s", file=sys.stderr,
                      flush=True)
    fidelity["greedy_ar_same_tokens"] = [ar_tokens[("fsd", i)] == ar_tokens[("torch", i)] for i in range(len(prompts))]
    fidelity["greedy_ar_first_difference"] = [
        next((j for j, (a, c) in enumerate(zip(ar_tokens[("fsd", i)], ar_tokens[("torch", i)])) if a != c), None)
        for i in range(len(prompts))]
    print(f"{args.weights} weights, {torch.get_num_threads()} threads, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, greedy, K=5, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'rule':<5} {'fsd tok/s':>10} {'torch tok/s':>12} {'fsd/torch':>10}")
    table = {}
    for rule in rules:
        f, t = statistics.median(tps[("fsd", rule)]), statistics.median(tps[("torch", rule)])
        table[rule] = dict(fsd=f, torch=t, ratio=f / t, fsd_runs=tps[("fsd", rule)], torch_runs=tps[("torch", rule)])
        print(f"{rule:<5} {f:>10.2f} {t:>12.2f} {f / t:>9.2f}x")
    print(json.dumps(fidelity))
    Path(args.output).write_text(json.dumps(dict(args=vars(args), threads=torch.get_num_threads(),
                                                 table=table, fidelity=fidelity), indent=2))


if __name__ == "__main__":
    main()
