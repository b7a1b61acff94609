// The CUDA kernels and their host launchers (csrc/fsd/cuda/*.cu, unchanged), compiled by the host
// C++ compiler against the CPU simulation of the CUDA runtime in include/ (which must come first on
// the include path): fsd::cuda::launch_accept and the other launchers then run on the CPU.
#include <cuda_runtime.h>

namespace fsd {
namespace cuda {
// The dynamic shared memory of the staged cluster kernel (its `extern __shared__ uint4 stage[]`):
// as much as a launch may ask for, one copy per OS thread (per block of a cluster). Defined before
// the kernels, so that they see a thread-local without dynamic initialisation.
thread_local uint4 stage[sim::kMaxDynamicShared / sizeof(uint4)];
}  // namespace cuda
}  // namespace fsd

#include "fsd/cuda/accept.cu"
#include "fsd/cuda/accept_bf16.cu"
#include "fsd/cuda/accept_f16.cu"
#include "fsd/cuda/accept_float.cu"
#include "fsd/cuda/rows.cu"
