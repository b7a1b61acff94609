// fsd_ext.accept on CUDA for float16 logits (see accept_typed.cuh).
#include "fsd/cuda/accept_typed.cuh"

namespace fsd {
namespace cuda {

template cudaError_t launch_accept_typed<Float16>(const AcceptProblem&, const AcceptPlan&, char*, cudaStream_t);
template bool cluster_fits<Float16>(int64_t);
template bool decide_kernel_waits<Float16>();

}  // namespace cuda
}  // namespace fsd
