// The checks of the core's C++ test programs: EXPECT counts a failure and reports where, main
// returns the count's verdict (test_core.cpp, test_streaming.cu).
#pragma once

#include <cmath>
#include <cstdio>

namespace fsd_test {
inline int failures = 0;

// Exit status of a test program: 0 when every check passed.
inline int verdict(const char* program) {
  if (failures) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", program, failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", program);
  return 0;
}
}  // namespace fsd_test

#define EXPECT(cond)                                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++fsd_test::failures;                                                  \
    }                                                                        \
  } while (0)

#define EXPECT_NEAR(a, b, tol) EXPECT(std::fabs((double)(a) - (double)(b)) <= (tol))
