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
steps_table() {
  echo ">> ${STEPS_TITLE:-step times}"
  printf '   %-12s %8s\n' step seconds
  for i in "${!steps[@]}"; do
    printf '   %-12s %8s\n' "${steps[$i]}" "${times[$i]}"
  done
  printf '   %-12s %8s\n' total $((SECONDS - steps_started))
}
trap steps_table EXIT
