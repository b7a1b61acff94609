#!/usr/bin/env bash
# Sanitizer job (issue 6): AddressSanitizer + UndefinedBehaviorSanitizer over
#   1. the framework-free core (CMake -DFSD_SANITIZE=ON) and its C++ unit tests under ctest;
#   2. the torch extension built with FSD_EXT_SANITIZE=1 in a copy of the tree (the normal
#      in-place build is left alone), and a sanitizer-sized slice of the Python tests run on it
#      with libasan preloaded.
# Fails (exit 1) on any sanitizer report or test failure.
#
#   scripts/sanitize.sh           # everything (scripts/full_check.sh)
#   scripts/sanitize.sh --slice   # CI's slice: the C++ unit tests but not the CUDA simulation, and
#                                 # the Python slice at 150 fuzz examples
#
# Environment: FSD_SANITIZE_DIR (work dir, default build/sanitize), FSD_SANITIZE_JOBS (default 2),
# FSD_SANITIZE_FUZZ_EXAMPLES (fuzz examples of the Python slice, default 600, --slice 150),
# FSD_SANITIZE_PARTS ("core python" by default; name one to run only that part).
set -euo pipefail
SLICE_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --slice) SLICE_ONLY=1 ;;
    *) echo "sanitize.sh: unknown argument $arg (usage: sanitize.sh [--slice])" >&2; exit 2 ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${FSD_SANITIZE_DIR:-$ROOT/build/sanitize}
JOBS=${FSD_SANITIZE_JOBS:-2}
PYTHON=${PYTHON:-python}
mkdir -p "$WORK"

# halt on the first error of either sanitizer; Python leaks by design, so no leak checking.
# Reports also go to files ($WORK/reports/asan.PID, ubsan.PID): pytest captures fd 2 during a test,
# and a report that ends the process would otherwise vanish with the capture.
rm -rf "$WORK/reports"
mkdir -p "$WORK/reports"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:strict_init_order=1:log_path=$WORK/reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87:log_path=$WORK/reports/ubsan"

fail_on_reports() {  # $@: logs that must hold no sanitizer report (plus the report files)
  if grep -s -E "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|UndefinedBehaviorSanitizer" \
      "$@" "$WORK"/reports/*; then
    echo "sanitize.sh: sanitizer report (see above and $WORK/reports)" >&2
    head -60 "$WORK"/reports/* >&2 2>/dev/null || true
    exit 1
  fi
}

step() { echo "== sanitize.sh: $* ($(date -u +%H:%M:%S))"; }

PARTS=${FSD_SANITIZE_PARTS:-core python}

# ---- 1. core + C++ tests ------------------------------------------------------------------------
if [[ " $PARTS " == *" core "* ]]; then
step "core: cmake -DFSD_SANITIZE=ON"
cmake -S "$ROOT" -B "$WORK/core" -DFSD_SANITIZE=ON -DFSD_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$WORK/cmake.log"
CTEST_ARGS=()
if (( SLICE_ONLY )); then
  # (the C++ unit tests, not test_cuda_sim: its fixed checks alone take minutes under ASan)
  UNIT_TESTS=(test_core test_sanitize_core test_quant_gemm test_skinny_gemm test_int8_gemm test_decode_ops)
  cmake --build "$WORK/core" -j "$JOBS" --target "${UNIT_TESTS[@]}" > "$WORK/build_core.log" 2>&1 \
    || { tail -50 "$WORK/build_core.log"; exit 1; }
  CTEST_ARGS=(-R "^($(IFS='|'; echo "${UNIT_TESTS[*]}"))\$")
else
  cmake --build "$WORK/core" -j "$JOBS" > "$WORK/build_core.log" 2>&1 || { tail -50 "$WORK/build_core.log"; exit 1; }
fi
step "core: ctest"
# (test_cuda_sim runs its full default campaign here too: its fibers tell ASan of every stack
# switch instead of going through swapcontext, which ASan slowed down ~15x; FSD_SIM_CASES may cut it.)
if ! ctest --test-dir "$WORK/core" --output-on-failure -j "$JOBS" "${CTEST_ARGS[@]}" > "$WORK/ctest.log" 2>&1; then
  cat "$WORK/ctest.log"; fail_on_reports "$WORK/ctest.log"; exit 1
fi
fail_on_reports "$WORK/ctest.log"
grep -E "tests passed|Total Test" "$WORK/ctest.log" || true
fi
[[ " $PARTS " == *" python "* ]] || { step "ok: no sanitizer reports"; exit 0; }

# ---- 2. the extension, in a copy -----------------------------------------------------------------
step "extension: FSD_EXT_SANITIZE=1 build in $WORK/py"
mkdir -p "$WORK/py"
# Sources and tests only (never the in-place _C*.so or build/ of the normal build); the copy keeps
# its own build/ between runs so a rebuild is incremental.
(cd "$ROOT" && tar -cf - --exclude='__pycache__' --exclude='_C*.so' setup.py pyproject.toml csrc fsd_ext tests) \
  | (cd "$WORK/py" && tar -xf -)
(cd "$WORK/py" && FSD_EXT_SANITIZE=1 FSD_EXT_CUDA=0 MAX_JOBS="$JOBS" "$PYTHON" setup.py build_ext --inplace \
  > "$WORK/build_ext.log" 2>&1) || { tail -50 "$WORK/build_ext.log"; exit 1; }

# The extension must really be instrumented.
SO=$(ls "$WORK"/py/fsd_ext/_C*.so)
SYMBOLS=$(nm -D "$SO")  # (not `nm | grep -q`: grep's early exit fails the pipe under pipefail)
grep -q __asan_report <<< "$SYMBOLS" || { echo "sanitize.sh: $SO is not built with ASan" >&2; exit 1; }
grep -q __ubsan_handle <<< "$SYMBOLS" || { echo "sanitize.sh: $SO is not built with UBSan" >&2; exit 1; }

LIBASAN=$(g++ -print-file-name=libasan.so)
LIBUBSAN=$(g++ -print-file-name=libubsan.so)
[ -f "$LIBASAN" ] || { echo "sanitize.sh: libasan not found ($LIBASAN)" >&2; exit 1; }

# The slice: the fuzz tests at a sanitizer-sized example count, opcheck (without torch.compile),
# concurrency, and the kernel-vs-reference tests without the large-vocabulary cases.
SLICE=(tests/test_fuzz.py tests/test_opcheck.py tests/cpu_linear/test_opcheck_cpu_linear.py tests/test_threads_memory.py)
[ -f "$WORK/py/tests/test_accept.py" ] && SLICE+=(tests/test_accept.py)
step "python slice under ASan/UBSan: ${SLICE[*]}"
set +e
(cd "$WORK/py" && \
  PYTHONPATH="$WORK/py" LD_PRELOAD="$LIBASAN $LIBUBSAN" \
  FSD_FUZZ_EXAMPLES="${FSD_SANITIZE_FUZZ_EXAMPLES:-$(( SLICE_ONLY ? 150 : 600 ))}" FSD_MEMORY_REPEATS=0 \
  PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 \
  "$PYTHON" -m pytest -q -x -p no:cacheprovider "${SLICE[@]}" \
    -k "not compiles and not memory and not 151936 and not 32000" > "$WORK/pytest.log" 2>&1)
# (-x stops at the first failure; a sanitizer report ends the process with exit 86 / 87)
status=$?
set -e
tail -5 "$WORK/pytest.log"
fail_on_reports "$WORK/pytest.log"
if [ $status -ne 0 ]; then
  echo "sanitize.sh: python slice failed (exit $status; 86 = ASan report, 87 = UBSan report)" >&2
  tail -80 "$WORK/pytest.log" >&2
  exit 1
fi
# The tests must have run on the sanitized build, not an installed copy.
(cd "$WORK/py" && PYTHONPATH="$WORK/py" LD_PRELOAD="$LIBASAN" "$PYTHON" -c \
  "import fsd_ext._C as c, sys; sys.exit(0 if c.__file__.startswith('$WORK/py') else 1)") \
  || { echo "sanitize.sh: fsd_ext._C was not the sanitized build" >&2; exit 1; }
step "ok: no sanitizer reports"
