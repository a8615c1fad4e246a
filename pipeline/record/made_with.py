"""What a run's notes and mails are made with, as the run records it, so that a note or mail made
again under the run's note numbers and Message-IDs (a rerun, `run --run-id` resuming the day), or
a report rewritten after it (`reconcile`, `bounces`, `close`), says what the run's said, wherever
the command runs and whatever its shell names: the issuing entity's file (its name, tariff and
note prefix), the holidays' (the settlement dates), and the settings a note or its mail carries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from pipeline.record.manifest import load_first_notes, load_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import TEMPLATES, ConfigError, Settings

log = logging.getLogger("pipeline.record.made_with")
NOTE_FILES = {"broker_file": ("CN_BROKER_FILE", str(TEMPLATES / "broker.json")), "holidays_file": ("CN_HOLIDAYS_FILE", "")}
"""Each setting naming such a file: its variable and the file read when it is unset."""
RUN_SETTINGS = ("encryption", "pdf_tags", "sign_reason", "sign_location", "sign_contact", "mail_from", "mail_reply_to",
                "bounce_local", "bounce_domain", "link_days", "paper_due_days")
"""The settings a note, its mail or the run's paper list carries: the run's, in every later command.
Not the DKIM selector and domain, which go with the shell's key (rotated yearly), nor the link's
base, which is where the status service is now. Encryption may only be made stronger; CORRECTABLE
ones may be taken from the shell."""
STRONGER = {"encryption": "aes256"}  # a run made with none by mistake is rerun encrypted when the shell asks it
CORRECTABLE = ("pdf_tags", "sign_reason", "sign_location", "sign_contact", "mail_reply_to", "link_days")
"""Those a command may take from its shell instead (CN_SHELL_SETTINGS). Not encryption (only made
stronger), the From (DKIM aligns with it), the bounce address (`bounces` matches the run's), nor
the paper due days (the page counts with the run's)."""
KEYS = (*NOTE_FILES, *(f"{f}_sha256" for f in NOTE_FILES), "made_with")  # in Redis's meta and the report
ENV = {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}
_TOLD_SAID: set[tuple] = set()  # (run, setting, the shell's value, the run's): said once a process


def recorded(settings: Settings) -> dict[str, str]:
    """What a run records (in Redis, its manifest, its first notes' record and its report): each
    file's path and digest, and the settings as JSON (`made_with`)."""
    paths = {f: getattr(settings, f) for f in NOTE_FILES}
    return {**paths, **{f"{f}_sha256": sha256(p or NOTE_FILES[f][1]) or "" for f, p in paths.items()},
            "made_with": json.dumps({f: getattr(settings, f) for f in RUN_SETTINGS}, sort_keys=True)}


def resumed(settings: Settings, run_id: str, command: str = "run") -> Settings:
    """`settings` made with the run's own files and settings, for a run that already began: as
    Redis recorded them, else its manifest, else its first notes' record (a run resumed after its
    head, and Redis, were lost). A new run id, or a run from before they were recorded:
    `settings` as they are."""
    found = RunState.of(settings, run_id).meta()
    if "broker_file" not in found:
        store = open_store(settings.store_url)
        split, made = load_manifest(store, run_id), load_first_notes(store, run_id)
        found = (split.made_with if split else {}) or (made or {}).get("made_with") or {}
    settings = dataclasses.replace(settings, **{f: _chosen(run_id, found, settings, f) for f in NOTE_FILES
                                                if f in found})
    return run_settings(settings, found, run_id, command)


def run_settings(settings: Settings, found: dict, run_id: str, command: str) -> Settings:
    """`settings` with the run's own RUN_SETTINGS from `found` (its meta, or its report), each
    that differs from this shell's said in a WARNING line, but those the shell was told to keep
    (CN_SHELL_SETTINGS: a reply address mistyped at the run, corrected for its reruns)."""
    values, told = value(found), shell_settings(settings)
    differ = {f: values[f] for f in RUN_SETTINGS if f in values and values[f] != getattr(settings, f)
              and STRONGER.get(f) != getattr(settings, f)}
    for f, v in differ.items():
        if f in told:
            if (run_id, f, getattr(settings, f), v) in _TOLD_SAID:
                continue  # a rerun resumes the run too, which finds the told setting again
            _TOLD_SAID.add((run_id, f, getattr(settings, f), v))
        log.warning("%s %s: %s is %s", command, run_id, ENV[f],
                    f"this shell's {getattr(settings, f)!r}, as CN_SHELL_SETTINGS asks, not the run's {v!r}" if f in told
                    else f"the run's {v!r}, not this shell's {getattr(settings, f)!r}")
    return dataclasses.replace(settings, **{f: v for f, v in differ.items() if f not in told})


def shell_settings(settings: Settings) -> set[str]:
    """The fields CN_SHELL_SETTINGS names. A name not in CORRECTABLE is refused, and so is one
    this shell does not set (the default would be mailed as the correction)."""
    names = {n.strip() for n in settings.shell_settings.split(",") if n.strip()}
    ours = {ENV[f]: f for f in CORRECTABLE}
    if names - ours.keys():
        raise ConfigError(f"CN_SHELL_SETTINGS names {', '.join(sorted(names - ours.keys()))}: it takes only "
                          f"{', '.join(ours)} from the shell; the run's others are the run's")
    unset = sorted(n for n in names if n not in os.environ and getattr(settings, ours[n]) == getattr(Settings, ours[n]))
    if unset:
        raise ConfigError(f"CN_SHELL_SETTINGS names {', '.join(unset)}, which this shell does not set: set the value "
                          "to take")
    return {ours[n] for n in names}


def taken(settings: Settings, record: dict) -> dict:
    """What these settings take from the shell (CN_SHELL_SETTINGS) that differs from the run's
    `record`: what its notes and mails are made with now that its record does not say."""
    runs = value(record)
    return {f: getattr(settings, f) for f in sorted(shell_settings(settings)) if f in runs and runs[f] != getattr(settings, f)}


def kept(record: dict, settings: Settings) -> dict:
    """A begun run's record as its start writes it again: the run's own, but for encryption a
    command made stronger, which the run keeps from then on (its next rerun, from the shell that
    made the mistake, encrypts too)."""
    return stronger(record, {"made_with": {f: getattr(settings, f) for f in STRONGER}})


def stronger(record: dict, other: dict) -> dict:
    """`record`, but for a STRONGER setting that `other` has stronger: a run brought back from a
    report written before a rerun made its encryption stronger (the rerun wrote that to the
    manifest as it began, then died) keeps it."""
    made, theirs = value(record), value(other)
    up = {f: v for f, v in STRONGER.items() if f in made and theirs.get(f) == v != made[f]}
    return {**record, "made_with": json.dumps({**made, **up}, sort_keys=True)} if up else record


def strengthened(record: dict, before: dict) -> bool:
    """Whether `record` makes a STRONGER setting stronger than `before` recorded it."""
    now, then = value(record), value(before)
    return any(now.get(f) == v != then.get(f) and f in then for f, v in STRONGER.items())


def value(found: dict, field: str | None = None, default=None):
    """The run's recorded settings ({} for a run from before), or one of them (`default` if not
    recorded): what a view of the run (the status page) shows it with."""
    made = found.get("made_with") or {}
    try:
        made = json.loads(made) if isinstance(made, str) else made
    except ValueError:
        raise ConfigError("the run's record of its settings (made_with) is not JSON (edited?)") from None
    return made if field is None else made.get(field, default)


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
