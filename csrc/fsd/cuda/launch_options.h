// Launch choices of the CUDA launchers that are not the planner's: the caller passes them, so a
// launch is a function of its arguments (tests and benchmarks set them per call). The defaults
// are the planner's paths; the torch binding fills them from one switch (docs/cuda.md,
// "Launch options"). Plain C++: the binding includes it without the CUDA runtime.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace fsd {
namespace cuda {

struct LaunchOptions {
  // > 0: the split paths (accept, sample) cut each row into this many vocabulary chunks (capped
  // by the planners' smallest chunk and kMaxSplits) instead of the planner's choice.
  int64_t splits = 0;
  // accept's cluster path (sm_90+, no filters): one launch, a cluster barrier instead of
  // the split path's second launch. Not yet measured on a GPU.
  bool cluster = false;
  // accept's split path launches its second kernel by programmatic dependent launch (sm_90+).
  bool dependent_launch = false;
  // accept's split path runs its second kernel's items in reverse order (accept.cuh says why).
  bool reverse_decide = false;
  // The launchers print the path each call takes on stderr.
  bool log = false;
};

// Parses "name=value,name=value" (names splits, cluster, pdl, reverse, log; splits a positive
// integer, the others 0 or 1; empty text: the defaults) into `out`. Returns "" or what is wrong.
inline std::string parse_launch_options(const std::string& text, LaunchOptions& out) {
  LaunchOptions options;
  size_t from = 0;
  while (from < text.size()) {
    const size_t comma = std::min(text.find(',', from), text.size());
    const std::string entry = text.substr(from, comma - from);
    from = comma + 1;
    const size_t eq = entry.find('=');
    const std::string name = entry.substr(0, eq), value = eq == std::string::npos ? "" : entry.substr(eq + 1);
    char* end = nullptr;
    const long long n = value.empty() ? -1 : std::strtoll(value.c_str(), &end, 10);
    const bool integer = !value.empty() && *end == '\0';
    if (name == "splits") {
      if (!integer || n < 0) return "splits wants a non-negative integer (0: the planner's choice), got '" + value + "'";
      options.splits = (int64_t)n;
      continue;
    }
    bool* flag = name == "cluster" ? &options.cluster
                 : name == "pdl"   ? &options.dependent_launch
                 : name == "reverse" ? &options.reverse_decide
                 : name == "log"   ? &options.log
                                   : nullptr;
    if (flag == nullptr)
      return "unknown option '" + name + "' (expected splits=N, cluster=0|1, pdl=0|1, reverse=0|1, log=0|1)";
    if (!integer || (n != 0 && n != 1)) return name + " wants 0 or 1, got '" + value + "'";
    *flag = n == 1;
  }
  out = options;
  return "";
}

}  // namespace cuda
}  // namespace fsd
