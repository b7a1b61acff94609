// CPU simulation (see ../../cuda_runtime.h) of cub::BlockScan: exclusive prefix sums in thread
// order, the block aggregate in every thread.
#pragma once

#include <new>

#include "../../cuda_runtime.h"

namespace cub {

template <typename T, int kBlockThreads>
class BlockScan {
 public:
  struct TempStorage {
    alignas(T) unsigned char values[sizeof(T) * kBlockThreads];
  };
  explicit BlockScan(TempStorage& temp) : temp_(temp) {}

  void ExclusiveSum(T input, T& output, T& aggregate) {
    T* values = reinterpret_cast<T*>(temp_.values);
    const int t = (int)threadIdx.x;
    new (values + t) T(input);
    __syncthreads();
    T before = T(), total = T();
    for (int i = 0; i < (int)blockDim.x; ++i) {
      if (i == t) before = total;
      total = total + values[i];
    }
    __syncthreads();
    output = before;
    aggregate = total;
  }

 private:
  TempStorage& temp_;
};

}  // namespace cub
