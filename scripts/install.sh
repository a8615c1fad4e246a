#!/usr/bin/env bash
# Installs everything this project needs on a fresh Debian machine (as root), idempotently:
# system packages and the Python environment in .venv. What only the tests need (an
# S3-compatible server) installs with the test command, scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# dovecot-imapd and postfix: the tests' bounce mailbox and bouncing relay (each test starts its own);
# opendkim: the tests' DKIM-signing relay (Postfix with OpenDKIM as its milter);
# softhsm2 and p11-kit: the embedded default's and the tests' HSM token, in process and behind `p11-kit server`;
# gcc, libssl-dev and python3-dev: the C functions (pipeline/native.py builds each *.c under pipeline/; the R6
# password hash links libcrypto, and the extension modules build against the Python's headers);
# libjemalloc2: the allocator a local run's Ray processes run with (pipeline/cluster/driver.py, workers_malloc)
APT_PACKAGES=(redis-server poppler-utils qpdf fonts-noto-core fonts-noto-mono fonts-dejavu-core chromium
              dovecot-imapd postfix opendkim softhsm2 p11-kit p11-kit-modules gcc libc6-dev libssl-dev python3-dev libjemalloc2)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}" >&2
  apt-get update -qq
  # no daemon is started by the install (policy-rc.d 101): the tests start their own, on loopback
  had_policy=$([[ -e /usr/sbin/policy-rc.d ]] && echo y || true)
  [[ $had_policy ]] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [[ $had_policy ]] || rm -f /usr/sbin/policy-rc.d
fi

stamp=".venv/.requirements.sha256"
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [[ ! -x .venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "installing the Python environment in .venv" >&2
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # pip compiles each installed module in one process (37 s of a 65-s install here); compileall does it on
  # every core (23 s), and a clean clone's test command waits for it
  .venv/bin/pip install -q --no-compile -r requirements.txt
  .venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    || echo "warning: some installed modules did not byte-compile (pip leaves them so too); they are compiled as imported" >&2
  echo "$want" > "$stamp"
fi
.venv/bin/python -m pipeline.native  # built once per version of their source, in ~/.cache/contract-notes
.venv/bin/python -m pipeline.note.fonts  # the note's lean font faces, made once, beside it
