#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments the `ray up` tests go in a pytest session of their own beside the rest, which
# runs in two processes: most of their minutes are spent waiting (a simulated cloud's instances, a
# relay paced at 0.5 mails/s), and the serial suite kept this machine's two cores a quarter busy.
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
    # test taken by whichever process is free, unless the arguments say how many.
    if [[ " $* " == *" -m quick "* && " $* " != *" -n "* ]]; then
        set -- -n 3 --dist worksteal "$@"
    fi
    exec .venv/bin/python -m pytest "$@"
fi
# Beside the rest, in a session of their own: the `ray up` tests (mostly waiting on a simulated
# cloud), the relays held to their rates (mostly waiting on the rates) and the days that lose
# nodes (each a process of its own). The rest runs in two processes (pytest-xdist, --dist
# loadgroup): its slow tests in turn in one, on that process's one Ray; the quick tests and the
# benchmarks' smoke runs in whichever is free (tests/conftest.py). In one process the rest took
# 21m41s of a 22m30s suite, both cores 81% busy; in two, 15m13s, and the other session (then with
# the benchmarks) 20m16s, so the benchmarks came over. Three sessions (the `ray up` tests in one of
# their own) took 33m47s: on two cores the simulated cloud's nodes are busy too.
side=(tests/test_ray_up.py tests/test_relay_rates.py tests/test_node_loss.py)
side_log=$(mktemp -t cn-side-tests.XXXXXX)
.venv/bin/python -m pytest -p no:cacheprovider "${side[@]}" >"$side_log" 2>&1 &
side_pid=$!
trap 'kill "$side_pid" 2>/dev/null || true' EXIT  # this script's own session, by PID
rest=0
.venv/bin/python -m pytest -n 2 --dist loadgroup "${side[@]/#/--ignore=}" || rest=$?
side_rc=0
wait "$side_pid" || side_rc=$?
trap - EXIT
echo "=== ${side[*]}, in their own session beside the rest ==="
cat "$side_log"
rm -f "$side_log"
echo "=== pytest exit status: the rest $rest, ${side[*]} $side_rc ==="
((rest == 0 && side_rc == 0)) || exit $((rest ? rest : side_rc))
