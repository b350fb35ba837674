# The step helpers of the bounded device-call scripts (workflows_check.sh, followup_run.sh),
# sourced by them: BUDGET (seconds for the whole call), STEPS (the steps wanted) and COMMIT are
# the caller's. On the device pass COMMIT=<hash> in the command: the device's copy of .git need
# not be the checkout's (a run of 65616e2 read 0406a45 there).
left() { echo $((BUDGET - SECONDS)); }
want() { [[ " $STEPS " == *" $1 "* ]]; }
# Runs "$@" for at most $1 seconds and never past the budget (less 5 s for the last lines);
# skips it, saying so, when fewer than 20 seconds would be left for it.
bounded() {
    local cap=$1; shift
    local t=$(( $(left) - 5 ))
    (( t > cap )) && t=$cap
    if (( t < 20 )); then echo "skipped for want of time: $*"; return 0; fi
    timeout "$t" "$@"
}
# The first lines of a log: the commit and the command.
header() { printf '# commit %s\n# %s\n' "$COMMIT" "$*"; }
