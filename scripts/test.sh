#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments, three pytest sessions side by side, each with its own servers and Ray:
# the `ray up` tests, the mail paths that spend their time waiting (a relay down for 20 s, an
# HSM behind a slow link, Postfix and Dovecot), and the rest; then the relay-rate tests in a
# session alone, since their shares and paces need CPU the other sessions would take. One
# session alone kept this machine's two cores 39% busy for 16 minutes: it mostly waits.
# The rest's output comes first and in full, the other sessions' logs after it.
# With arguments, one session runs exactly what they name.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check pipeline actors bench tests scripts
.venv/bin/lint-imports --no-cache  # the layers of pipeline/ (pyproject.toml, [tool.importlinter])
if (($#)); then
    exec .venv/bin/python -m pytest "$@"
fi
cloud=(tests/test_ray_up.py)
waiting=(tests/test_faults.py tests/test_hsm.py tests/test_bounces.py)
timed=(tests/test_relay_rates.py)
logs=$(mktemp -d -t cn-tests.XXXXXX)
.venv/bin/python -m pytest -p no:cacheprovider "${cloud[@]}" >"$logs/cloud" 2>&1 &
cloud_pid=$!
.venv/bin/python -m pytest -p no:cacheprovider "${waiting[@]}" >"$logs/waiting" 2>&1 &
waiting_pid=$!
trap 'kill "$cloud_pid" "$waiting_pid" 2>/dev/null || true' EXIT  # this script's own sessions, by PID
rest=0
.venv/bin/python -m pytest "${cloud[@]/#/--ignore=}" "${waiting[@]/#/--ignore=}" "${timed[@]/#/--ignore=}" || rest=$?
cloud_rc=0 waiting_rc=0 timed_rc=0
wait "$cloud_pid" || cloud_rc=$?
wait "$waiting_pid" || waiting_rc=$?
trap - EXIT
.venv/bin/python -m pytest -p no:cacheprovider "${timed[@]}" >"$logs/timed" 2>&1 || timed_rc=$?
for session in waiting timed cloud; do
    echo "=== the $session session ==="
    cat "$logs/$session"
done
rm -rf "$logs"
echo "=== pytest exit status: the rest $rest, waiting $waiting_rc, timed $timed_rc, cloud $cloud_rc ==="
for rc in "$rest" "$waiting_rc" "$timed_rc" "$cloud_rc"; do ((rc == 0)) || exit "$rc"; done
