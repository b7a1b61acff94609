// CPU simulation (see cuda_runtime.h here) of the cooperative-groups calls fsd-ext's kernels make:
// coalesced_threads / labeled_partition / reduce in add_to_bin (radix_select.cuh). Here every group is the
// calling thread alone, one of the partitions the CUDA model allows (lanes that diverged each form
// their own coalesced group), so a group's reduction is the thread's own value. this_cluster().sync()
// is the simulation's cluster barrier (a block barrier outside a cluster launch: a cluster of one).
#pragma once

#include "cuda_runtime.h"

namespace cooperative_groups {

struct coalesced_group {
  unsigned thread_rank() const { return 0; }
  unsigned size() const { return 1; }
};
inline coalesced_group coalesced_threads() { return {}; }
template <typename Label>
coalesced_group labeled_partition(const coalesced_group&, Label) { return {}; }

template <typename T>
struct plus {
  T operator()(const T& a, const T& b) const { return a + b; }
};
template <typename T, typename Op>
T reduce(const coalesced_group&, T value, Op) { return value; }

struct cluster_group {
  void sync() const { sim::cluster_sync(); }
};
inline cluster_group this_cluster() { return {}; }

}  // namespace cooperative_groups
