// The CUDA kernels and their host launchers (csrc/fsd/cuda/*.cu, unchanged), compiled by the host
// C++ compiler against the CPU simulation of the CUDA runtime in include/ (which must come first on
// the include path): fsd::cuda::launch_accept and the other launchers then run on the CPU.
#include <cuda_runtime.h>

#include "fsd/cuda/accept.cu"
#include "fsd/cuda/accept_bf16.cu"
#include "fsd/cuda/accept_f16.cu"
#include "fsd/cuda/accept_float.cu"
#include "fsd/cuda/rows.cu"
