# Step timing for .ci/run and scripts/full_check.sh (sourced): `step TITLE` starts a step and ends
# the one before; `background_start TITLE LOG CMD...` runs a command beside the steps and
# `background_wait` waits for it, prints its log and fails with it; on exit, whatever the status,
# a table gives each step's seconds.
STEPS_T0=$(date +%s)
STEP_TITLES=()
STEP_SECONDS=()
_step_title=""
_step_t0=""
BG_PID=""

_step_close() {
  if [[ -n "$_step_t0" ]]; then
    STEP_TITLES+=("$_step_title")
    STEP_SECONDS+=($(( $(date +%s) - _step_t0 )))
    _step_t0=""
  fi
}

step() {
  _step_close
  echo
  echo "=== $* ($(( $(date +%s) - STEPS_T0 ))s) ==="
  _step_title="$*"
  _step_t0=$(date +%s)
}

background_start() {  # TITLE LOG CMD...: CMD runs at the lowest CPU priority
  BG_TITLE="$1" BG_LOG="$2"
  shift 2
  BG_T0=$(date +%s)
  # A session of its own, so that a failed run can stop the whole group. Where the kernel groups
  # the scheduling by session (autogroup), a nice value counts only inside the group: the group's
  # own nice is raised too, else it would take half the CPU from the steps.
  setsid bash -c 'echo 19 > /proc/self/autogroup 2>/dev/null; exec nice -n 19 "$@"' background "$@" \
    > "$BG_LOG" 2>&1 &
  BG_PID=$!
  echo "=== in the background from $(( BG_T0 - STEPS_T0 ))s: $BG_TITLE (log: $BG_LOG) ==="
}

background_wait() {
  step "wait for the background step: $BG_TITLE"
  local status=0
  wait "$BG_PID" || status=$?
  BG_PID=""
  STEP_TITLES+=("$BG_TITLE (in the background, from $(( BG_T0 - STEPS_T0 ))s)")
  STEP_SECONDS+=($(( $(date +%s) - BG_T0 )))
  cat "$BG_LOG"
  if (( status != 0 )); then
    echo "=== FAILED (exit $status): $BG_TITLE" >&2
    return "$status"
  fi
}

steps_report() {
  local status=$?
  [[ -n "$BG_PID" ]] && kill -- "-$BG_PID" 2>/dev/null
  _step_close
  echo
  echo "=== step times (seconds; total $(( $(date +%s) - STEPS_T0 )), exit status $status)"
  local i
  for i in "${!STEP_TITLES[@]}"; do printf '%6d  %s\n' "${STEP_SECONDS[$i]}" "${STEP_TITLES[$i]}"; done
  return "$status"
}
trap steps_report EXIT
