"""Checks that GCC vectorises every hot row loop of the CPU kernels, in every SIMD clone.

The CPU kernels get their speed from plain loops over fixed-size lane arrays that the compiler turns
into SIMD code (csrc/fsd/cpu/vec.h); nothing fails when one silently stops vectorising, it just runs
several times slower. That happened once: a select in the JS divergence's term made GCC turn a
loop-invariant load into a masked one it could not vectorise, and the whole loop fell back to
scalar code (JS 4x slower than KL, FSD-strict 5x slower than SD). This compiles the CPU kernels'
sources exactly as setup.py does (its cxx_flags; FSD_CPU_CLONES makes an x86-64-v4, an x86-64-v3
and an AVX clone of each hot function beside the baseline one), reads GCC's vectoriser report, and
fails when a SIMD clone of any instance of the hot templates below vectorises no loop. The baseline
(SSE2) clones are counted but not required: SSE2 has no 64-bit integer compare, which the general
divergence loop (one-hot ids) needs, and machines without AVX are rare.

    python scripts/check_cpu_vectorization.py            # CXX (g++) override; exit 1 on a miss
    python scripts/check_cpu_vectorization.py --list     # also print every instance and its count
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The per-id loops: each SIMD clone of each instance must vectorise at least one loop (its lanes).
HOT = ["sum_range", "scan_row", "block_maxima", "smallest_kept", "dot_rows", "widen_bfloat16"]
SIMD_CLONES = ["arch_x86_64_v4", "arch_x86_64_v3", "avx"]  # GCC's suffixes for FSD_CPU_CLONES' targets


def setup_cxx_flags():
    """The `cxx_flags = [...]` list setup.py builds the extension with (one source of truth)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "cxx_flags" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    raise SystemExit("check_cpu_vectorization: no cxx_flags list in setup.py")


def vectorised_loops(dump_path):
    """{assembler name: number of loops GCC vectorised} from a -fdump-tree-vect-details file.
    A clone's assembler name is the function's plus `.<target>`."""
    counts, current = {}, None
    for line in open(dump_path, errors="replace"):
        m = re.match(r";; Function .* \((\S+), funcdef_no", line)
        if m:
            current = m.group(1)
            counts.setdefault(current, 0)
        elif current is not None and "LOOP VECTORIZED" in line:
            counts[current] += 1
    return counts


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def template_name(function):
    """`fsd::cpu::(anonymous namespace)::dot_rows<1>(...)` -> `dot_rows`; None outside fsd::cpu
    (the FSD core) and fsd_cpu_linear (the CPU linear kernels)."""
    m = re.match(r"(?:\S+ )?(?:fsd::cpu|fsd_cpu_linear)::(?:\(anonymous namespace\)::)?(\w+)", function)
    return m.group(1) if m else None


def check(sources, cxx, listing):
    """(hot instances found per template, SIMD clones that vectorise nothing, baseline ones)."""
    found, misses, baseline_misses = {name: 0 for name in HOT}, [], []
    flags = setup_cxx_flags()
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            dump = os.path.join(tmp, os.path.basename(src) + ".vect")
            cmd = [cxx, *flags, "-I", os.path.join(ROOT, "csrc"), "-c", src, "-o", os.devnull,
                   f"-fdump-tree-vect-details={dump}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"check_cpu_vectorization: {os.path.basename(src)} failed to compile")
            counts = vectorised_loops(dump)
            asm_names = list(counts)
            bases = [name.split(".")[0] for name in asm_names]
            for asm_name, function in zip(asm_names, demangle(bases)):
                name = template_name(function)
                if name not in found:
                    continue
                clone = asm_name.split(".")[1] if "." in asm_name else "default"
                loops = counts[asm_name]
                if listing:
                    print(f"  {clone:15s} {loops} {function[:140]}")
                if clone == "default":
                    found[name] += 1
                    if loops == 0:
                        baseline_misses.append(function)
                elif clone in SIMD_CLONES and loops == 0:
                    misses.append(f"{function} [{clone}]")
    return found, misses, baseline_misses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print every instance with its vectorised loops")
    args = parser.parse_args()
    cxx = os.environ.get("CXX", "g++")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()
    if not version or "g++" not in version[0] and "GCC" not in version[0]:
        print(f"check_cpu_vectorization: {cxx} is not GCC (the report read is GCC's); skipped")
        return 0
    print(f"== {version[0]}")
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "fsd", "cpu", "*.cpp"))
                     + glob.glob(os.path.join(ROOT, "csrc", "cpu_linear", "*_gemm.cpp")))
    found, misses, baseline_misses = check(sources, cxx, args.list)
    total = sum(found.values())
    print(f"== {total} instances of the hot loops ({', '.join(f'{n} {k}' for k, n in found.items())}); "
          f"SIMD clones ({', '.join(SIMD_CLONES)}) vectorising nothing: {len(misses)}; "
          f"baseline clones vectorising nothing (allowed): {len(baseline_misses)}")
    for function in misses:
        print(f"NOT VECTORISED: {function}")
    absent = [name for name, n in found.items() if n == 0]
    for name in absent:  # renamed or no longer instantiated: HOT must follow
        print(f"NOT FOUND: no instance of {name}")
    return 1 if misses or absent else 0


if __name__ == "__main__":
    sys.exit(main())
