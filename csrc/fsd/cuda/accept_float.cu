// fsd_ext.accept on CUDA for float32 logits (see accept_typed.cuh).
#include "fsd/cuda/accept_typed.cuh"

namespace fsd {
namespace cuda {

template cudaError_t launch_accept_typed<float>(const AcceptProblem&, const AcceptPlan&, char*, cudaStream_t);
template bool cluster_fits<float>(int64_t);
template bool decide_kernel_waits<float>();

}  // namespace cuda
}  // namespace fsd
