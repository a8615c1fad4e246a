#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments, three pytest sessions at once (below): in one, the `ray up` and browser tests spend
# most of their minutes waiting (a simulated cloud's instances, a run followed in Chromium), then the
# end-to-end tests run; the other tests that mostly wait (a relay paced at 0.5 mails/s, an outage's
# 20 s) follow the quick session, once its processes have ended.
# With arguments, one session runs exactly what they name (`-m quick`, the quick lane, in three
# processes at once).
set -euo pipefail
cd "$(dirname "$0")/.."

# The tests' S3-compatible server (versitygw), built once with Go and cached outside the repo. Debian's own
# Go (1.19) is too old for it. On a fresh machine its build (~2.5 min of both cores) goes on while
# install.sh's packages download and unpack, not after them.
VERSITYGW_VERSION=v1.8.0
TOOLS="${CN_TOOLS_DIR:-$HOME/.cache/contract-notes-tools}"
build=""
if [[ ! -x "$TOOLS/bin/versitygw-$VERSITYGW_VERSION" ]]; then
  command -v go >/dev/null || { echo "error: the tests' S3 server (versitygw $VERSITYGW_VERSION) is built with Go 1.25 or newer, and there is no go on PATH (install it from go.dev, or put a built versitygw at $TOOLS/bin/versitygw-$VERSITYGW_VERSION)" >&2; exit 2; }
  echo "building versitygw $VERSITYGW_VERSION (S3-compatible server for the tests; once per machine)" >&2
  mkdir -p "$TOOLS/bin"
  build_log=$(mktemp -t cn-versitygw-build.XXXXXX)
  GOBIN="$TOOLS/bin" go install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION" >"$build_log" 2>&1 &
  build=$!
  trap 'kill "$build" 2>/dev/null || true' EXIT  # an install that fails leaves no build behind
fi
bash scripts/install.sh

# What only the tests need: iptables and prometheus for the simulated cloud's nodes (cluster.yaml's rule
# on the dashboard agent's port, and the head's Prometheus, both from the OS's archive as on the AMI),
# and faketime (close typed as the README prints it, the clock past the bounce window).
missing=$(for p in iptables prometheus faketime; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"; done)
[[ -z "$missing" ]] || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null; }
if [[ $build ]]; then
  wait "$build" || { cat "$build_log" >&2; echo "error: building versitygw $VERSITYGW_VERSION failed" >&2; exit 2; }
  trap - EXIT
  rm -f "$build_log"
  mv "$TOOLS/bin/versitygw" "$TOOLS/bin/versitygw-$VERSITYGW_VERSION"
fi
ln -sf "$TOOLS/bin/versitygw-$VERSITYGW_VERSION" .venv/bin/versitygw
.venv/bin/ruff check pipeline actors bench tests scripts
.venv/bin/lint-imports --no-cache  # the layers of pipeline/ (pyproject.toml, [tool.importlinter])
if (($#)); then
    # The quick lane's tests mostly wait (their servers' start, timeouts, child processes): in one
    # process they kept a core 45% busy for 5 minutes. So it runs in three (pytest-xdist), each
    # test taken by whichever process is free, unless the arguments choose (-n, --numprocesses,
    # -p no:xdist) or need one process (--pdb).
    if [[ " $* " == *" -m quick "* && ! " $* " =~ \ (-n|--numprocesses|--pdb|no:xdist) ]]; then
        set -- -n 3 --dist worksteal "$@"
    fi
    exec .venv/bin/python -m pytest "$@"
fi
# Three sessions at once, each its own processes and log:
# - the slow tests (Ray, whole days, demos), in turn in one process, on its one Ray;
# - beside them, in a session of their own, the `ray up` tests (mostly waiting on a simulated cloud)
#   and the browser's (Chromium following a run), marked `waits` (tests/conftest.py), then the
#   end-to-end tests;
# - the quick tests and the benchmarks' smoke runs (each a process of its own, with a Ray of its
#   own), in two processes (pytest-xdist), each test taken by whichever is free; once both have
#   ended, the other tests marked `waits`: the relays held to their rates, the days that lose nodes,
#   and the slow tests that wait out an outage or a period. In one session with the `ray up` tests,
#   after them, that session was the longest (26m06s of 27m08s on a slow hour).
# With the quick tests among the slow ones, in one process, that session took 21m41s of a 22m30s
# suite, both cores 81% busy, and ended last. A fourth session from the start, the `ray up` tests apart from
# the other side's, took 33m47s: on two cores the simulated cloud's nodes are busy too. The slow tests in
# two processes (pytest-xdist) took 28m00s against 27m34s in one: the cores are busy until the
# quick session ends, and the slow tests' last five minutes, alone, kept them 20-50% busy.
# No faster (docs/benchmarks.md, one run each): the sessions niced to order the CPU (31m02s against
# 28m06s; two benches' local Rays failed) and the quick session in one process, its benchmarks last (28m50s).
side_log=$(mktemp -t cn-side-tests.XXXXXX)
free_log=$(mktemp -t cn-free-tests.XXXXXX)
late_log=$(mktemp -t cn-late-tests.XXXXXX)
free_rc_file=$(mktemp -t cn-free-rc.XXXXXX)
# The tests that wait longest, from the start; then, in the same session, the end-to-end tests (slow ones, about
# half waiting): with them among the slow tests, that session ended last, ~5.5 minutes after this one (24m41s
# against 19m09s on a slow hour; docs/benchmarks.md has the runs since). With the autoscaler's day here too,
# the suite took 22m55s and 22m21s against 20m52s the same quiet hour, the slow tests no shorter.
side=(tests/test_ray_up.py tests/test_browser.py tests/test_end_to_end.py)
.venv/bin/python -m pytest -p no:cacheprovider -m "waits or not (quick or bench)" "${side[@]}" >"$side_log" 2>&1 &
side_pid=$!
# The quick tests and the benchmarks in two processes, then the other tests that wait: beside the quick
# session's first minutes (all cores busy), the waits of a node-loss day and a paced relay ran long.
(trap 'kill $(jobs -p) 2>/dev/null; exit 143' TERM  # stopped: the session under way, and no later one
 .venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist worksteal -m "(quick or bench) and not waits" \
   >"$free_log" 2>&1 & rc=0; wait $! || rc=$?; echo "$rc" >"$free_rc_file"
 .venv/bin/python -m pytest -p no:cacheprovider -m waits "${side[@]/#/--ignore=}" >"$late_log" 2>&1 & wait $!) &
rest_pid=$!
.venv/bin/python -m pytest -m "not quick and not bench and not waits" "${side[@]/#/--ignore=}" &
slow_pid=$!
trap 'kill "$side_pid" "$rest_pid" "$slow_pid" 2>/dev/null || true' EXIT  # this script's own sessions, by PID
slow=0
wait "$slow_pid" || slow=$?
side_rc=0 late_rc=0
wait "$side_pid" || side_rc=$?
wait "$rest_pid" || late_rc=$?
free_rc=$(cat "$free_rc_file"); free_rc=${free_rc:-1}  # none written: its session never ended
trap - EXIT
echo "=== the ray up, browser and end-to-end tests, in their own session beside the slow tests ==="
cat "$side_log"
echo "=== the quick tests and the benchmarks' smoke runs, in two processes beside them ==="
cat "$free_log"
echo "=== the other tests that mostly wait (-m waits), after the quick session ==="
cat "$late_log"
rm -f "$side_log" "$free_log" "$late_log" "$free_rc_file"
echo "=== pytest exit status: the slow tests $slow, the ray up, browser and end-to-end tests $side_rc, the quick ones and the benchmarks" \
  "$free_rc, the other tests that wait $late_rc ==="
((slow == 0 && side_rc == 0 && free_rc == 0 && late_rc == 0)) ||
  exit $((slow ? slow : side_rc ? side_rc : free_rc ? free_rc : late_rc))
