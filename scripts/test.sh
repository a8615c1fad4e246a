#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
# With no arguments the `ray up` tests run in a pytest session of their own beside the
# rest: they spend most of their seven or eight minutes waiting (a simulated cloud's
# instances, a relay paced at 0.5 mails/s), and the serial suite kept this machine's two
# cores a quarter busy.
# With arguments, one session runs exactly what they name.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

# What only the tests need: an S3-compatible server (versitygw), built once with Go and cached
# outside the repo. Debian's own Go (1.19) is too old for it.
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
cloud_log=$(mktemp -t cn-ray-up-tests.XXXXXX)
.venv/bin/python -m pytest -p no:cacheprovider tests/test_ray_up.py >"$cloud_log" 2>&1 &
cloud=$!
trap 'kill "$cloud" 2>/dev/null || true' EXIT  # this script's own session, by PID
rest=0
.venv/bin/python -m pytest --ignore=tests/test_ray_up.py || rest=$?
cloud_rc=0
wait "$cloud" || cloud_rc=$?
trap - EXIT
echo "=== tests/test_ray_up.py, in its own session beside the rest ==="
cat "$cloud_log"
rm -f "$cloud_log"
echo "=== pytest exit status: the rest $rest, tests/test_ray_up.py $cloud_rc ==="
((rest == 0 && cloud_rc == 0)) || exit $((rest ? rest : cloud_rc))
