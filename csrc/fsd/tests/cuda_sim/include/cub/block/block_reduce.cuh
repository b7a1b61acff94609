// CPU simulation (see ../../cuda_runtime.h) of cub::BlockReduce: the threads publish their values,
// thread 0 folds them in thread order. As in CUB the result is defined in thread 0 only; the other
// threads get their own input back, so code that reads it elsewhere computes garbage here too.
#pragma once

#include <new>

#include "../../cuda_runtime.h"

namespace cub {

template <typename T, int kBlockThreads>
class BlockReduce {
 public:
  struct TempStorage {
    alignas(T) unsigned char values[sizeof(T) * kBlockThreads];  // raw: T may have initialisers
  };
  explicit BlockReduce(TempStorage& temp) : temp_(temp) {}

  template <typename Op>
  T Reduce(T input, Op op) {
    T* values = reinterpret_cast<T*>(temp_.values);
    const int t = (int)threadIdx.x;
    new (values + t) T(input);
    __syncthreads();
    T out = input;
    if (t == 0)
      for (int i = 1; i < (int)blockDim.x; ++i) out = op(out, values[i]);
    __syncthreads();  // the storage may be reused right after
    return out;
  }
  T Sum(T input) {
    return Reduce(input, [](const T& a, const T& b) { return a + b; });
  }

 private:
  TempStorage& temp_;
};

}  // namespace cub
