#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments the `ray up` tests, and the benchmarks' smoke runs, go in pytest sessions of
# their own beside the rest: the `ray up` tests spend most of their minutes waiting (a simulated
# cloud's instances, a relay paced at 0.5 mails/s), and the serial suite kept this machine's two
# cores a quarter busy.
# With arguments, one session runs exactly what they name.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

# What only the tests need: iptables and prometheus for the simulated cloud's nodes (cluster.yaml's rule
# on the dashboard agent's port, and the head's Prometheus, both from the OS's archive as on the AMI),
# faketime (close typed as the README prints it, the clock past the bounce window), and an S3-compatible
# server (versitygw), built once with Go and cached outside the repo. Debian's own Go (1.19) is too old for it.
missing=$(for p in iptables prometheus faketime; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"; done)
[[ -z "$missing" ]] || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null; }
VERSITYGW_VERSION=v1.8.0
TOOLS="${CN_TOOLS_DIR:-$HOME/.cache/contract-notes-tools}"
if [[ ! -x "$TOOLS/bin/versitygw-$VERSITYGW_VERSION" ]]; then
  command -v go >/dev/null || { echo "error: the tests' S3 server (versitygw $VERSITYGW_VERSION) is built with Go 1.25 or newer, and there is no go on PATH (install it from go.dev, or put a built versitygw at $TOOLS/bin/versitygw-$VERSITYGW_VERSION)" >&2; exit 2; }
  echo "building versitygw $VERSITYGW_VERSION (S3-compatible server for the tests; once per machine)" >&2
  mkdir -p "$TOOLS/bin"
  GOBIN="$TOOLS/bin" go install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION"
  mv "$TOOLS/bin/versitygw" "$TOOLS/bin/versitygw-$VERSITYGW_VERSION"
fi
ln -sf "$TOOLS/bin/versitygw-$VERSITYGW_VERSION" .venv/bin/versitygw
.venv/bin/ruff check pipeline actors bench tests scripts
.venv/bin/lint-imports --no-cache  # the layers of pipeline/ (pyproject.toml, [tool.importlinter])
if (($#)); then
    exec .venv/bin/python -m pytest "$@"
fi
# Beside the rest, two sessions of their own: the `ray up` tests (mostly waiting on a simulated
# cloud's instances), and the relays held to their rates (mostly waiting on the rates) with the
# benchmarks' smoke runs and the days that lose nodes (each a process of its own, with its own
# Ray). The three take about as long, and the two cores stay busy (two sessions left them a
# quarter idle, and took 26 min)
cloud=(tests/test_ray_up.py)
paced=(tests/test_relay_rates.py tests/test_benches.py tests/test_node_loss.py)
logs=() pids=()
for group in "${cloud[*]}" "${paced[*]}"; do
  logs+=("$(mktemp -t cn-tests.XXXXXX)")
  # shellcheck disable=SC2086  # the group's paths, split on their spaces
  .venv/bin/python -m pytest -p no:cacheprovider $group >"${logs[-1]}" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT  # this script's own sessions, by PID
rest=0
.venv/bin/python -m pytest "${cloud[@]/#/--ignore=}" "${paced[@]/#/--ignore=}" || rest=$?
codes=()
for i in "${!pids[@]}"; do
  code=0
  wait "${pids[i]}" || code=$?
  codes+=("$code")
done
trap - EXIT
for i in "${!logs[@]}"; do
  echo "=== session $((i + 2)) of 3, beside the rest ==="
  cat "${logs[i]}"
  rm -f "${logs[i]}"
done
echo "=== pytest exit status: the rest $rest, ${cloud[*]} ${codes[0]}, ${paced[*]} ${codes[1]} ==="
((rest == 0 && codes[0] == 0 && codes[1] == 0)) || exit $((rest ? rest : codes[0] ? codes[0] : codes[1]))
