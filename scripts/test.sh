#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments, three pytest sessions side by side, each with its own servers and Ray:
# the `ray up` tests, the mail-path tests that spend their time waiting on relays (paced,
# throttled, down for 20 s) and an HSM, and the rest. One session alone kept this machine's
# two cores 39% busy for 16 minutes: it mostly waits. The rest's output comes last and in
# full; the other two sessions' logs are printed after it.
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
waiting=(tests/test_relay_rates.py tests/test_faults.py tests/test_hsm.py tests/test_bounces.py)
logs=$(mktemp -d -t cn-tests.XXXXXX)
.venv/bin/python -m pytest -p no:cacheprovider "${cloud[@]}" >"$logs/cloud" 2>&1 &
cloud_pid=$!
.venv/bin/python -m pytest -p no:cacheprovider "${waiting[@]}" >"$logs/waiting" 2>&1 &
waiting_pid=$!
trap 'kill "$cloud_pid" "$waiting_pid" 2>/dev/null || true' EXIT  # this script's own sessions, by PID
rest=0
.venv/bin/python -m pytest "${cloud[@]/#/--ignore=}" "${waiting[@]/#/--ignore=}" || rest=$?
cloud_rc=0 waiting_rc=0
wait "$cloud_pid" || cloud_rc=$?
wait "$waiting_pid" || waiting_rc=$?
trap - EXIT
echo "=== ${waiting[*]}, in a session of their own ==="
cat "$logs/waiting"
echo "=== ${cloud[*]}, in a session of its own ==="
cat "$logs/cloud"
rm -rf "$logs"
echo "=== pytest exit status: the rest $rest, the waiting mail paths $waiting_rc, tests/test_ray_up.py $cloud_rc ==="
((rest == 0 && waiting_rc == 0 && cloud_rc == 0)) || exit $((rest ? rest : waiting_rc ? waiting_rc : cloud_rc))
