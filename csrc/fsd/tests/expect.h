// The checks of the core's C++ test programs: EXPECT and CHECK count a failure and report where
// (CHECK with a printf-style message, the first 30 only), main returns the count's verdict.
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

#define CHECK(cond, ...)                                                              \
  do {                                                                                \
    if (!(cond) && ++fsd_test::failures <= 30) {                                      \
      std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);  \
      std::fprintf(stderr, __VA_ARGS__);                                              \
      std::fprintf(stderr, "\n");                                                     \
    }                                                                                 \
  } while (0)
