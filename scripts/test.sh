#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what is missing, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check pipeline actors bench tests scripts
.venv/bin/lint-imports --no-cache  # the layers of pipeline/ (pyproject.toml, [tool.importlinter])
exec .venv/bin/python -m pytest "$@"
