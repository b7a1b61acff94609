// fsd_ext.accept on CUDA for bfloat16 logits (see accept_typed.cuh).
#include "fsd/cuda/accept_typed.cuh"

namespace fsd {
namespace cuda {

template cudaError_t launch_accept_typed<BFloat16>(const AcceptProblem&, const AcceptPlan&, char*, cudaStream_t);
template bool cluster_fits<BFloat16>(int64_t);
template bool decide_kernel_waits<BFloat16>();

}  // namespace cuda
}  // namespace fsd
