# shellcheck shell=bash
# Sourced by the scripts that run several steps (scripts/test.sh, scripts/ci_quick.sh,
# .ci/run): `step NAME COMMAND...` runs one step and times it, and at exit (also after a
# failure) a table of each step's seconds is printed under the title in $STEPS_TITLE.
steps=()
times=()
steps_started=$SECONDS
step() {
  local name=$1 t0=$SECONDS
  shift
  steps+=("$name")
  times+=("failed") # until it finishes
  "$@"
  times[${#times[@]} - 1]=$((SECONDS - t0))
}
# `step_start NAME COMMAND...` starts a step in the background, its output into
# target/steps/NAME.log, and `step_join NAME` waits for it, prints that log and times it from
# its start: for work that fills a core another step leaves idle (one long single-threaded
# test; tests that mostly wait on sockets). With STEP_NICE=N the step yields to the rest.
declare -A step_pids=() step_starts=()
step_start() {
  local name=$1
  shift
  mkdir -p target/steps
  step_starts[$name]=$SECONDS
  # setsid: a session and process group of its own (its PID), so that an exit ends it with
  # all it started. A new session is also a new scheduler autogroup where the kernel has
  # them (Linux's default), and nice values only order processes within an autogroup: so
  # STEP_NICE is set on the step's autogroup, from inside it.
  setsid bash -c 'if [[ -n ${STEP_NICE:-} ]]; then echo "$STEP_NICE" >/proc/self/autogroup 2>/dev/null || renice -n "$STEP_NICE" $$ >/dev/null; fi; exec "$@"' \
    step "$@" >"target/steps/$name.log" 2>&1 &
  step_pids[$name]=$!
}
step_join() {
  local name=$1 rc=0
  steps+=("$name")
  times+=("failed")
  wait "${step_pids[$name]}" || rc=$?
  unset "step_pids[$name]"
  echo ">> $name (ran in the background; its output)"
  cat "target/steps/$name.log"
  ((rc == 0)) || return "$rc"
  times[${#times[@]} - 1]=$((SECONDS - step_starts[$name]))
}
steps_table() {
  echo ">> ${STEPS_TITLE:-step times}"
  printf '   %-12s %8s\n' step seconds
  for i in "${!steps[@]}"; do
    printf '   %-12s %8s\n' "${steps[$i]}" "${times[$i]}"
  done
  printf '   %-12s %8s\n' total $((SECONDS - steps_started))
}
steps_exit() {
  local pid
  for pid in "${step_pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  steps_table
}
trap steps_exit EXIT
