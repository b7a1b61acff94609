// Compiler attributes of the hand-vectorised CPU loops, shared on purpose by the FSD core's CPU
// kernels (csrc/fsd/cpu) and the CPU linear component (csrc/cpu_linear), which include nothing
// else of each other: x86 target clones, forced inlining and the simd pragma.
#pragma once

// The hot row loops are compiled once per x86 SIMD level and picked at load time (GCC/Clang
// function multi-versioning), so a build runs AVX-512 / AVX2 / AVX code where the CPU has it and
// SSE2 elsewhere. FSD_NO_CLONES (set by sanitizer builds) turns this off. GCC 13.2-14.2 crash on
// some lambdas handed to these templates: see Dist::log_prob_float in fsd/numerics.h.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(FSD_NO_CLONES)
#define FSD_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "avx", "default")))
#else
#define FSD_CPU_CLONES
#endif

#if defined(__GNUC__)
#define FSD_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FSD_ALWAYS_INLINE inline
#endif

// For a lambda handed to a vectorised loop (sum_range): it must be inlined to vectorise, and GCC
// leaves a large one (a divergence term: two exps and a log) as one call per element otherwise.
#if defined(__GNUC__)
#define FSD_INLINE_LAMBDA __attribute__((always_inline))
#else
#define FSD_INLINE_LAMBDA
#endif

// Marks the fixed-width lane loops for the vectoriser (needs -fopenmp-simd; a no-op without it).
#define FSD_SIMD _Pragma("omp simd")
