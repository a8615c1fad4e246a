"""The files a run's notes are made from, as the run records them, and which a resumed run or a
rerun reads: the issuing entity's (its name, tariff and note prefix) and the holidays' (the
settlement dates). A note made again under the run's note numbers must say what the run's
notes said, wherever the command runs and whatever its shell names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from pipeline.record.manifest import load_first_notes, load_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import TEMPLATES, ConfigError, Settings

log = logging.getLogger("pipeline.record.note_files")
NOTE_FILES = {"broker_file": ("CN_BROKER_FILE", str(TEMPLATES / "broker.json")), "holidays_file": ("CN_HOLIDAYS_FILE", "")}
"""Each setting naming such a file: its variable and the file read when it is unset."""


def recorded(settings: Settings) -> dict[str, str]:
    """What a run records of them (in Redis, its manifest, its first notes' record and its
    report): each one's path and digest."""
    paths = {f: getattr(settings, f) for f in NOTE_FILES}
    return {**paths, **{f"{f}_sha256": sha256(p or NOTE_FILES[f][1]) or "" for f, p in paths.items()}}


def resumed(settings: Settings, run_id: str) -> Settings:
    """`settings` with the run's own files, for a run that already began: as Redis recorded them,
    else its manifest, else its first notes' record (a run resumed after its head, and Redis,
    were lost). A new run id, or a run from before they were recorded: `settings` as they are."""
    found = RunState.of(settings, run_id).meta()
    if "broker_file" not in found:
        store = open_store(settings.store_url)
        split, made = load_manifest(store, run_id), load_first_notes(store, run_id)
        found = (split.note_files if split else {}) or (made or {}).get("note_files") or {}
    return dataclasses.replace(settings, **{f: _chosen(run_id, found, settings, f) for f in NOTE_FILES if f in found})


def sha256(path: str) -> str | None:
    """A file's digest ("": no file named; None: no such file here)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
    except OSError:
        return None


def _chosen(run_id: str, found: dict, settings: Settings, field: str) -> str:
    """The path the run recorded while the file there is the one it read; else the shell's
    setting when it names a copy of that file (another machine); refused when neither does,
    rather than a note made again with another entity, tariff or settlement date. A run from
    before digests were recorded: its path, as then."""
    env, default = NOTE_FILES[field]
    path, digest, own = found[field], found.get(f"{field}_sha256"), getattr(settings.anchored(), field)
    named, here = path or default or f"no {env}", sha256(path or default)
    if digest and here != digest:
        where = "not on this machine" if here is None else "changed since the run"
        if sha256(own or default) != digest:
            raise ConfigError(f"run {run_id}: its notes were made from {named} ({env}) as it was at the run (sha256 "
                              f"{digest[:16]}...), which is {where}; {env} ({own or 'unset'}) is not that file either: "
                              "set it to a copy of the run's")
        log.warning("run %s: the run's %s %s is %s; %s is that file, used", run_id, env, named, where, own or default)
        return own
    if path != own:
        log.warning("run %s: its notes are made from %s, as the run recorded (not %s %s)", run_id, named, env,
                    own or "unset")
    return path
