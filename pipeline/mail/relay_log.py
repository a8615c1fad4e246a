"""The Message-IDs a relay accepted, read from the relay's own log.

Three formats, told apart line by line, so one file may mix them:

- **Postfix** (syslog or `maillog_file`): `cleanup[...]: QUEUEID: message-id=<ID>` names the
  message, and `qmgr[...]: QUEUEID: from=<...>, size=..., nrcpt=... (queue active)` shows that
  the queue file was committed, i.e. Postfix answered 250. A message-id line alone is not
  enough: cleanup logs it while the data is still arriving.
- **Haraka** (its default, `logfmt` or `json` log format): `[core] message mid=<ID> ...`
  names the transaction's message, and `[core] queue code=OK` on the same transaction id
  (`UUID.N`) is its acceptance; `code=` anything else is not.
- **A plain list**: one Message-ID per line, with or without the angle brackets.

Anything else (connection lines, deliveries to the next hop) is ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

POSTFIX = re.compile(r"postfix(?:-[\w.-]+)?/(cleanup|qmgr)\[\d+\]: ([0-9A-Za-z]+): (.*)$")
HARAKA = re.compile(r"\[(?:[A-Z]+)\] \[([0-9A-Fa-f-]+\.\d+)\] \[core\] (message|queue) (.*)$")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')
PLAIN = re.compile(r"^<?([^<>\s@]+@[^<>\s@]+)>?$")


def accepted_ids(paths: Iterable[Path]) -> set[str]:
    """Every Message-ID (as `<...>`) that the logs show as accepted."""
    postfix_ids: dict[str, str] = {}
    postfix_committed: set[str] = set()
    haraka_ids: dict[str, str] = {}
    haraka_ok: set[str] = set()
    plain: set[str] = set()
    for path in paths:
        with Path(path).open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                line = line.strip()
                if not line:
                    continue
                if m := POSTFIX.search(line):
                    process, queue_id, rest = m.groups()
                    if process == "cleanup" and rest.startswith("message-id="):
                        postfix_ids[queue_id] = _bracketed(rest[len("message-id="):])
                    elif process == "qmgr" and rest.startswith("from="):
                        postfix_committed.add(queue_id)
                elif event := _haraka(line):
                    txn, kind, fields = event
                    if kind == "message" and fields.get("mid"):
                        haraka_ids[txn] = _bracketed(fields["mid"])
                    elif kind == "queue" and fields.get("code") == "OK":
                        haraka_ok.add(txn)
                elif m := PLAIN.match(line):
                    plain.add(_bracketed(m.group(1)))
    return (plain | {mid for q, mid in postfix_ids.items() if q in postfix_committed}
            | {mid for t, mid in haraka_ids.items() if t in haraka_ok})


def _haraka(line: str) -> tuple[str, str, dict] | None:
    """(transaction id, event, fields) from a Haraka line in any of its three formats."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        uuid, event = str(record.get("uuid", "")), record.get("message", "")
        fields = {k: str(v) for k, v in record.items()}
    elif m := HARAKA.search(line):
        uuid, event, rest = m.groups()
        fields = _fields(rest)
    elif "uuid=" in line and "message=" in line:  # logfmt
        fields = _fields(line)
        uuid, event = fields.get("uuid", ""), fields.get("message", "")
    else:
        return None
    if event not in ("message", "queue") or "." not in uuid:
        return None
    return uuid, event, fields


def _fields(text: str) -> dict[str, str]:
    return {k: v[1:-1].replace('\\"', '"') if v.startswith('"') else v for k, v in FIELD.findall(text)}


def _bracketed(mid: str) -> str:
    mid = mid.strip()
    return mid if mid.startswith("<") else f"<{mid}>"
