"""The seal, tried as an auditor and an attacker would (issue 32, section 1): each attack on a
closed run's record is caught and named by `verify`, from storage alone; `close` seals once.
One run is mailed, bounced and closed for the module; each test works on a copy of its store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import redis as redis_module
import psutil
import pytest

from pipeline.__main__ import main
from pipeline.errors import CannotRun
from pipeline.followup import bounces, close as proof
from pipeline.followup.opened import open_run
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.followup.verify import exit_status, verify
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.embedded import start_smtp_sink
from pipeline.mail import verp
from pipeline.record import delivery_log, keys, spread
from pipeline.record.manifest import load_manifest
from pipeline.record.state import RunClosed, RunState
from pipeline.record.storage import FolderStore, Garbled, StorageError, open_store
from pipeline.seal import detached
from pipeline.seal.sign import make_test_certificate
from pipeline.seal.signer import load_signer
from pipeline.settings import ROOT, Settings
from tests import servers
from tests.conftest import TRADE_DATE


@pytest.fixture(scope="module")
def closed_run(ray_session, redis_url, keys_dir, tmp_path_factory):
    """(settings, run id, the store before close, the store after close, the accounts bounced)."""
    import datetime as dt

    work = tmp_path_factory.mktemp("proof")
    write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), 30, seed=11))
    sink = start_smtp_sink(work / "outbox", work / "smtp.log", ["--bounce-rate", "0.5", "--bounces", str(work / "dsns")])
    try:
        settings = Settings(store_url=str(work / "store"), redis_url=redis_url, smtp_url=sink.url, shard_size=8,
                            window=4, signers=1, mailers=1, signer_key=str(keys_dir / "signer.key.pem"),
                            signer_cert=str(keys_dir / "signer.cert.pem"), signer_chain=str(keys_dir / "root.cert.pem"),
                            owner_password="proof-owner-secret", token_key_file=str(keys_dir / "token.key"))
        run_id = run_day(settings, RunRequest(TRADE_DATE, str(work / "input")))["run_id"]
    finally:
        sink.stop()
    found = bounces.collect(settings, run_id, [str(work / "dsns")])
    assert found["bounced"] > 0, found
    shutil.copytree(work / "store", work / "open")
    proof.close(settings, run_id, now=after_the_window(settings, run_id))
    sent = [json.loads(line) for line in (work / "dsns.jsonl").read_text().splitlines()]
    bounced = [verp.parse(d["mail_from"].split("@")[0].split("+", 1)[1]).ucc for d in sent if d["kind"] == "bounced"]
    return settings, run_id, work / "open", work / "store", bounced


def after_the_window(settings: Settings, run_id: str) -> float:
    return float(RunState(settings.redis_url, run_id).meta()["finished"]) + 72 * 3600 + 1


def copy(of: Path, to: Path) -> Path:
    shutil.copytree(of, to)
    return to


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def chain(root: Path, run_id: str, shard: int) -> list[Path]:
    return [root / k for k in delivery_log.chain_keys(open_store(str(root)), run_id, shard)]


def relink(objects: list[Path]) -> None:
    """What an attacker with write access does after editing an object: every later object's
    link rewritten to match, so the chain is whole again."""
    for before, after in zip(objects, objects[1:]):
        header, body = after.read_bytes().split(b"\n", 1)
        fields = json.loads(header)
        fields["prev"] = hashlib.sha256(before.read_bytes()).hexdigest()
        after.write_bytes(json.dumps(fields, separators=(",", ":")).encode() + b"\n" + body)


def shard_of(root: Path, run_id: str, ucc: str) -> int:
    return keys.shard_of(ucc, load_manifest(open_store(str(root)), run_id).shard_count)


def verified(root: Path, run_id: str, **kw) -> dict:
    return verify(open_store(str(root)), run_id, **kw)


def test_a_sealed_run_verifies_and_an_open_one_is_not_yet_proof(closed_run, monkeypatch, capsys):
    settings, run_id, opened, sealed, _ = closed_run
    whole = verified(sealed, run_id)
    assert whole["ok"] and whole["sealed"] and exit_status(whole) == 0, whole
    assert whole["signed_by"].endswith(detached.fingerprint(Path(settings.signer_cert).read_bytes()))
    before = verified(opened, run_id)
    assert before["ok"] and not before["sealed"] and exit_status(before) == 3
    assert "not sealed: consistent so far, not yet proof" in before["summary"]
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    assert main(["verify", run_id, "--store", str(opened)]) == 3
    assert "not sealed: consistent so far, not yet proof" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "pipeline", "verify", run_id], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "REDIS_URL": settings.redis_url, "CN_STORE": str(opened)})
    assert done.returncode == 0 and f"verify {run_id}: store {sealed} (the run's own, recorded in Redis" in done.stderr, \
        done.stderr  # which store, and why, said without --verbose (CN_STORE is not the run's)


def test_the_first_object_edited_and_every_later_link_forged_is_named(closed_run, tmp_path):
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    objects[0].write_bytes(objects[0].read_bytes().replace(b'"at":1', b'"at":2', 1))
    relink(objects)
    found = verified(root, run_id)
    assert not found["ok"] and found["first_problem"].startswith(f"{objects[0].relative_to(root)}: changed"), found


@pytest.mark.parametrize("removed", [0, 1])
def test_an_object_removed_from_a_sealed_chain_is_named_as_removed(closed_run, tmp_path, removed):
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    assert len(objects) > removed + 1, "the shard has an object after the one removed"
    objects[removed].unlink()
    found = verified(root, run_id)
    assert not found["ok"] and exit_status(found) == 1
    assert found["first_problem"].startswith(f"{objects[removed].relative_to(root)}: removed"), found


def test_a_log_object_whose_stat_the_disk_fails_stops_verify_as_unread_never_named_removed(closed_run, tmp_path):
    """A folder store's listing passed over a file the disk could not stat (os.path.isfile says
    False on any error: EIO on a failing disk; ELOOP here, a link to itself), so verify named the
    log object removed: a sealed record read as tampered (exit 1) over a fault of the disk. It
    is a store that could not be read (exit 2: a retry after the repair finds the record whole)."""
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    objects[0].unlink()
    objects[0].symlink_to(objects[0].name)
    with pytest.raises(StorageError, match="cannot list .*Too many levels of symbolic links") as raised:
        verified(root, run_id)
    assert not isinstance(raised.value, Garbled), "not a changed record"
    assert main(["verify", run_id, "--store", str(root)]) == 2
    objects[0].unlink()  # the run's folder of a partition's log a link to itself: read as empty, each chain removed
    folder = objects[0].parent.parent
    assert folder.name == run_id and folder.parent.name.endswith("-delivery-log"), folder
    shutil.move(folder, tmp_path / "aside")
    folder.symlink_to(folder.name)
    with pytest.raises(StorageError, match="cannot list .*Too many levels of symbolic links"):
        verified(root, run_id)


def test_a_proof_whose_stat_the_disk_fails_stops_verify_as_unread_never_read_as_unsealed(closed_run, tmp_path):
    """A folder store's `exists` said False where the disk could not stat the object (Path.exists
    passes over ELOOP; here a link to itself), so a sealed run's proof read as never written:
    verify said "not sealed: close began ... and stopped before its proof" (exit 3). It is a
    store that could not be read (exit 2)."""
    _, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    proof_path = root / proof.proof_keys(run_id)[0]
    proof_path.unlink()
    proof_path.symlink_to(proof_path.name)
    with pytest.raises(StorageError, match="Too many levels of symbolic links"):
        verified(root, run_id)
    assert main(["verify", run_id, "--store", str(root)]) == 2


def test_a_proof_replaced_by_garbage_is_a_changed_record_exit_1_not_a_command_that_could_not_run(closed_run, tmp_path,
                                                                                                 capsys):
    settings, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    (root / proof.proof_keys(run_id)[0]).write_bytes(b"\x00 not json at all")
    found = verified(root, run_id)
    assert not found["ok"] and found["sealed"] and exit_status(found) == 1, found
    assert found["first_problem"].startswith(f"{proof.proof_keys(run_id)[0]}: changed"), found
    (root / proof.proof_keys(run_id)[0]).write_text('{"heads": "a string"}')
    assert exit_status(verified(root, run_id)) == 1
    assert main(["verify", run_id, "--store", str(root)]) == 1
    assert "changed" in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["the manifest removed", "the manifest and report removed",
                                  "the manifest not a manifest", "the report not JSON"])
def test_a_sealed_run_s_manifest_or_report_removed_or_garbled_is_changed_exit_1_not_a_run_never_made(
        closed_run, tmp_path, monkeypatch, capsys, edit):
    """Before, `verify` of a sealed run whose manifest was deleted said "no run" (exit 2, a command
    that could not run, which a script runs again), and one whose manifest or report was edited
    into something else stopped as on a failed read (exit 2): tampering never named."""
    settings, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    manifest, report_key = root / keys.manifest_key(run_id), root / keys.report_keys(run_id)[0]
    if edit.startswith("the manifest") and edit.endswith("removed"):
        manifest.unlink()
        if "report" in edit:
            report_key.unlink()
    elif edit == "the manifest not a manifest":
        manifest.write_text('{"shards": "all of them"}')
    else:
        report_key.write_bytes(report_key.read_bytes()[:40])
    named = keys.report_keys(run_id)[0] if edit == "the report not JSON" else keys.manifest_key(run_id)
    found = verified(root, run_id)
    assert not found["ok"] and exit_status(found) == 1 and found["first_problem"].startswith(
        f"{named}: {'removed' if edit.endswith('removed') else 'changed'}"), found
    laptop = settings.redis_url.rsplit("/", 1)[0] + "/13"  # a Redis without the run: the store given is where it is
    redis_module.Redis.from_url(laptop).flushdb()
    monkeypatch.setenv("REDIS_URL", laptop)
    assert main(["verify", run_id, "--store", str(root)]) == 1
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["objects as numbers", "a report that is a folder", "a report outside the store",
                                  "a report key added", "another run's"])
def test_a_well_formed_proof_edited_into_another_shape_is_changed_exit_1_never_a_traceback(
        closed_run, tmp_path, capsys, edit):
    """A copy of a sealed store with the proof's JSON edited: before, `objects` as numbers gave a
    TypeError traceback, a report key naming a folder an IsADirectoryError, and a key outside the
    store exit 2 "would leave the store". Any proof not exactly as close writes it is changed."""
    settings, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    path = root / proof.proof_keys(run_id)[0]
    made = json.loads(path.read_bytes())
    if edit == "objects as numbers":
        made["objects"] = {k: 5 for k in made["objects"]}
    elif edit == "a report that is a folder":
        made["reports"] = {"reports": "0" * 64}
    elif edit == "a report outside the store":
        made["reports"] = {**made["reports"], "../../../etc/hostname": "0" * 64}
    elif edit == "a report key added":
        made["reports"]["reports/another.json"] = "0" * 64
    else:
        made["run_id"] = "another-run"
    path.write_bytes(json.dumps(made, indent=0, sort_keys=True).encode())
    assert main(["verify", run_id, "--store", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"{proof.proof_keys(run_id)[0]}: changed" in err and "Traceback" not in err, err


def test_a_close_that_cannot_sign_writes_nothing_and_the_next_close_seals(ray_session, settings, day):
    """Before, with the key unreadable, close wrote a closing object into every chain, the report
    as closed and closed_at in Redis, then failed: verify called it tampering ("proof.json:
    removed") and rerun refused the run as sealed. Now it proves the key first."""
    import dataclasses

    run_id = run_day(settings, RunRequest(TRADE_DATE, str(day)))["run_id"]
    root = Path(settings.store_url)
    before = {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK}
    unreadable = dataclasses.replace(settings, signer_key=str(root.parent / "missing.pem"))
    with pytest.raises(CannotRun) as refused:
        proof.close(unreadable, run_id, now=after_the_window(settings, run_id))
    assert "missing.pem" in str(refused.value)
    assert {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK} == before, "close wrote before it could sign"
    assert not RunState(settings.redis_url, run_id).meta().get("closed_at")
    assert exit_status(verified(root, run_id)) == 3, "not sealed, and nothing reads as tampering"
    sealed = proof.close(settings, run_id, now=after_the_window(settings, run_id))
    assert not sealed["already_sealed"] and exit_status(verified(root, run_id)) == 0


@pytest.mark.parametrize("dies_in", ["seal", "the report's write"])
def test_a_close_that_stops_before_its_proof_reads_as_begun_and_the_next_close_seals_it(closed_run, tmp_path,
                                                                                         monkeypatch, dies_in):
    """Before, a close that died after its closing objects and before its proof left a record
    that verify called tampering ("proof.json: removed") and no close could tell from one. Now
    its signed warrant says where it began: verify says "begun" (exit 3), the next close finishes
    it, and a record changed meanwhile is refused by both. The report is written while the
    chains are closed: one that fails there is a close stopped before its proof, too."""
    settings, run_id, opened, _, bounced = closed_run
    stopped = copy(opened, tmp_path / "stopped")

    def dies(*_):
        raise OSError("the close's host went away")
    monkeypatch.setattr(*((proof, "seal") if dies_in == "seal" else (proof.report, "rewrite")), dies)
    with pytest.raises(OSError):
        proof.close(settings, run_id, store_url=str(stopped), now=after_the_window(settings, run_id))
    monkeypatch.undo()
    assert any(b'"status":"closed"' in p.read_bytes() for p in stopped.rglob("*.jsonl")), "it stopped mid-seal"
    begun = verified(stopped, run_id)
    assert begun["ok"] and exit_status(begun) == 3 and "close began" in begun["summary"], begun
    with pytest.raises(RunClosed, match="its close began and stopped before the seal"):  # not "sealed"
        with open_run(settings, run_id, str(stopped), command="rerun"):
            pass

    forged = copy(stopped, tmp_path / "forged")  # a mail logged after close began: not what the warrant allows
    store = open_store(str(forged))
    added = delivery_log.append(store, run_id, shard_of(forged, run_id, bounced[0]),
                                [{"ucc": bounced[0], "status": "delivered", "message_id": "x", "reply": "250", "at": 1}])
    found = verified(forged, run_id)
    assert exit_status(found) == 1 and added.key in found["first_problem"], found
    with pytest.raises(proof.SealBroken, match=added.key):
        proof.close(settings, run_id, store_url=str(forged), now=after_the_window(settings, run_id))

    sealed = proof.close(settings, run_id, store_url=str(stopped), now=after_the_window(settings, run_id))
    assert not sealed["already_sealed"] and exit_status(verified(stopped, run_id)) == 0
    assert sum(b'"status":"closed"' in p.read_bytes() for p in stopped.rglob("*.jsonl")) == \
        len(load_manifest(open_store(str(stopped)), run_id).shards), "one closing object a chain"


def test_an_archived_note_replaced_after_mailing_is_named_with_the_log_object_that_says_what_was_mailed(
        closed_run, tmp_path, capsys, monkeypatch):
    """The archive is what the client got, provably (issue 69): the delivery log names the
    SHA-256 of each note mailed, and verify holds every archived note to it. The log and the seal
    untouched, a note replaced in the archive fails the run, exit 1."""
    settings, run_id, _, sealed, _ = closed_run
    assert verified(sealed, run_id)["ok"], "untouched, it verifies"
    root = copy(sealed, tmp_path / "store")
    store = open_store(str(root))
    mailed = sorted(e["ucc"] for e in delivery_log.entries(store, run_id) if e["status"] == "delivered")
    victim = mailed[len(mailed) // 2]
    key = keys.signed_pdf_key(TRADE_DATE, victim)
    store.put(key, store.get(key).replace(b"%%EOF", b"%%EOF\n% signed again", 1))
    shard = shard_of(root, run_id, victim)
    logged = [k for k in delivery_log.chain_keys(store, run_id, shard) if any(
        e["ucc"] == victim and e.get("sha256") for e in delivery_log.parse(store, k, store.lines(k)))]

    found = verified(root, run_id)

    assert not found["ok"] and exit_status(found) == 1
    assert found["first_problem"] == f"{key}: differs from what was mailed (delivery log shard {shard} seq " \
                                     f"{delivery_log.seq_of(logged[0])})", found
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    assert main(["verify", run_id, "--store", str(root)]) == 1
    assert f"{key}: differs from what was mailed" in capsys.readouterr().err


def test_a_closed_run_whose_proof_was_deleted_and_a_bounce_edited_away_fails(closed_run, tmp_path):
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    for key in proof.proof_keys(run_id):
        (root / key).unlink()
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    holding = next(p for p in objects if b'"status":"bounced"' in p.read_bytes())
    holding.write_bytes(holding.read_bytes().replace(b'"status":"bounced"', b'"status":"deferred"'))
    relink(objects)
    found = verified(root, run_id)
    assert not found["ok"] and exit_status(found) == 1
    assert found["first_problem"].startswith(f"{holding.relative_to(root)}: changed"), found  # a link relinked
    assert any(p.startswith(f"{proof.proof_keys(run_id)[0]}: not there") for p in found["problems"]), found


def test_a_proof_deleted_and_a_bounce_appended_after_a_closing_object_is_named_not_read_as_begun(
        closed_run, tmp_path):
    """With the proof gone, a bounce appended after a chain's closing object read as a close that
    began (exit 3), and the next close sealed it in: docs/proof.md's promise that a proof deleted
    with any other change is named did not hold. No bounce reader writes beside a close now (it logs a
    bounce after close as refused after close), so such an entry is named, exit 1."""
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    for key in proof.proof_keys(run_id):
        (root / key).unlink()
    added = delivery_log.append(open_store(str(root)), run_id, shard_of(root, run_id, bounced[0]), [
        {"ucc": bounced[0], "status": "bounced", "kind": "bounced", "reason": "550 forged", "at": 2e9}])
    found = verified(root, run_id)
    assert exit_status(found) == 1 and found["first_problem"].startswith(f"{added.key}: a 'bounced' entry after "
                                                                         "the chain's closing object"), found


def test_close_seals_once_and_refuses_a_log_that_no_longer_matches_its_seal(closed_run, tmp_path):
    settings, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    before = tree(root)
    again = proof.close(settings, run_id, store_url=str(root))
    assert again["already_sealed"] and tree(root) == before, "a second close changes nothing"
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    objects[1].write_bytes(objects[1].read_bytes().replace(b'"status":"delivered"', b'"status":"failed"', 1))
    relink(objects)
    edited = tree(root)
    with pytest.raises(proof.SealBroken, match=str(objects[1].relative_to(root))):
        proof.close(settings, run_id, store_url=str(root))
    assert tree(root) == edited, "never sealed again"


def test_a_sealed_run_brought_back_from_storage_into_a_new_redis_writes_nothing_to_its_record(
        closed_run, tmp_path, monkeypatch, capsys):
    """The cluster and its Redis are gone. On a laptop, `status` reads the sealed run from its
    record, a refused `rerun` brings it back into Redis (the report's records and every shard's
    delivery log) and `close` shows its seal: the record is byte for byte what was sealed, and
    still verifies whole."""
    settings, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    before = {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK}
    monkeypatch.setenv("REDIS_URL", settings.redis_url.rsplit("/", 1)[0] + "/11")

    assert main(["status", run_id, "--store", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "sealed"
    assert main(["rerun", run_id, "--failed", "--store", str(root)]) == 2
    assert "closed and its record sealed" in capsys.readouterr().err
    back = RunState(os.environ["REDIS_URL"], run_id).meta()
    assert back["restored_from"], "the rerun brought the run back"
    assert back["message_ids"] == "keyed", "a token-less bounce is matched by its keyed Message-ID, as before the loss"
    assert main(["close", run_id, "--store", str(root)]) == 0
    assert {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK} == before
    assert verified(root, run_id)["ok"]


@pytest.mark.parametrize("close", ["sealed", "began"])
def test_a_run_whose_close_began_is_resumed_by_no_command_even_where_redis_lost_it(closed_run, tmp_path, monkeypatch,
                                                                                    capsys, close):
    """`run --run-id` looked at no seal: a sealed run resumed that way was mailed and its report
    written again, and verify then called the seal broken. And a close that stopped just after its
    warrant (its first write), on a laptop whose Redis never had the run, left a report with no
    `closed_at`: `rerun` brought the run back from it and went on. The close's own objects in
    storage now refuse both, and the record stays as the close left it, for the next close."""
    settings, run_id, opened, sealed, _ = closed_run
    if close == "sealed":
        root = copy(sealed, tmp_path / "store")
    else:  # the warrant written, nothing after it
        root = copy(opened, tmp_path / "store")
        for key in keys.closing_keys(run_id):
            (root / key).write_bytes((sealed / key).read_bytes())
    laptop = settings.redis_url.rsplit("/", 1)[0] + "/14"
    redis_module.Redis.from_url(laptop).flushdb()
    monkeypatch.setenv("REDIS_URL", laptop)
    before = {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK}
    said = "closed and its record sealed" if close == "sealed" else "its close began and stopped before the seal"

    assert main(["rerun", run_id, "--failed", "--store", str(root)]) == 2
    assert said in capsys.readouterr().err
    resumed = dataclasses.replace(settings, store_url=str(root), redis_url=laptop)
    with pytest.raises(RunClosed, match=said):
        run_day(resumed, RunRequest(TRADE_DATE, str(opened.parent / "input"), run_id))
    assert {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK} == before
    shown = "sealed" if close == "sealed" else "closing"  # the same in both tools, whatever Redis was told
    assert main(["status", run_id, "--store", str(root), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == shown and "rerun" not in status["next"] and "reconcile" not in status["next"], status
    assert close == "sealed" or f"close {run_id} again" in status["next"], status
    assert main(["runs", "--store", str(root), "--json"]) == 0
    assert [r["state"] for r in json.loads(capsys.readouterr().out) if r["run_id"] == run_id] == [shown]
    from fastapi.testclient import TestClient

    from pipeline.api import create_app
    launched = []
    with TestClient(create_app(dataclasses.replace(resumed, api_token="t0ken-for-the-page"),
                               launch=lambda *a: launched.append(a) or 1)) as page:
        assert page.get(f"/runs/{run_id}").json()["state"] == shown
        refused = page.post(f"/runs/{run_id}/rerun", json={"failed": True},
                            headers={"Authorization": "Bearer t0ken-for-the-page"})
        assert refused.status_code == 409 and said in refused.json()["detail"] and not launched, refused.text
    proof.close(resumed, run_id, now=after_the_window(settings, run_id))  # the close it began, finished
    assert verified(root, run_id)["ok"] and verified(root, run_id)["sealed"]


def test_a_run_resumed_where_redis_lost_it_keeps_its_bounces_and_its_first_start(closed_run, tmp_path):
    """`run --run-id`, the way back from a lost head, rebuilt Redis from each shard's mailings
    alone: a client the bounce reader had recorded bounced came out delivered in the report (and
    off the paper list), which verify then named against the log, and the run's start became the
    resume's. Each shard's log now gives back its bounces too, and the report its first start."""
    settings, run_id, opened, _, bounced = closed_run
    root = copy(opened, tmp_path / "store")  # the run as its bounce window ran, before close
    before = json.loads((root / keys.report_keys(run_id)[0]).read_text())
    assert before["statuses"].get("bounced") == len(bounced) > 0
    new_head = settings.redis_url.rsplit("/", 1)[0] + "/14"
    redis_module.Redis.from_url(new_head).flushdb()
    resumed = dataclasses.replace(settings, store_url=str(root), redis_url=new_head)
    after = run_day(resumed, RunRequest(TRADE_DATE, str(opened.parent / "input"), run_id))
    report = json.loads((root / keys.report_keys(run_id)[0]).read_text())
    assert (after["bounced"], report["statuses"].get("bounced")) == (len(bounced), len(bounced)), report["statuses"]
    assert report["started_at"] == before["started_at"], "the run's first start, not the resume's"
    assert verified(root, run_id)["ok"]


def test_after_the_seal_only_a_fetch_or_a_refused_bounce_may_follow(closed_run, tmp_path):
    _, run_id, _, sealed, bounced = closed_run
    root = copy(sealed, tmp_path / "store")
    store, shard = open_store(str(root)), shard_of(root, run_id, bounced[0])
    delivery_log.append(store, run_id, shard, [{"ucc": bounced[0], "status": "fetched", "at": 1.0}])
    fetched = verified(root, run_id)
    assert fetched["ok"] and fetched["added_after_seal"] == 1, fetched
    forged = delivery_log.append(store, run_id, shard, [{"ucc": bounced[0], "status": "delivered", "message_id": "x",
                                                         "reply": "250 ok", "at": 2e9}])
    found = verified(root, run_id)
    assert not found["ok"] and found["first_problem"].startswith(f"{forged.key}: a 'delivered' entry after the seal")


def test_close_refuses_to_seal_a_log_edited_before_it_naming_the_object_and_writes_nothing(closed_run, tmp_path):
    """Before, close checked an open run's record only where an earlier close had begun: it sealed
    the chains as it found them, an edited object too, and the record read as tampered for good
    (verify exit 1 over its own seal). docs/proof.md promised a refusal naming the object."""
    settings, run_id, opened, _, bounced = closed_run
    root = copy(opened, tmp_path / "store")
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    header, body = objects[0].read_bytes().split(b"\n", 1)
    assert len(objects) >= 2 and b'"status":"sending"' in body
    objects[0].write_bytes(header + b"\n" + body.replace(b'"status":"sending"', b'"status":"failed"', 1))
    assert not verified(root, run_id)["ok"]
    before = {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK}
    with pytest.raises(proof.SealBroken, match=f"{run_id} is not sealed .*{objects[0].relative_to(root)}: changed"):
        proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    assert {k: v for k, v in tree(root).items() if k != keys.WRITE_CHECK} == before, "no warrant, no closing object"


def test_a_log_edited_before_the_seal_is_caught_by_the_report_it_no_longer_matches(closed_run, tmp_path):
    settings, run_id, opened, _, bounced = closed_run
    root = copy(opened, tmp_path / "store")
    objects = chain(root, run_id, shard_of(root, run_id, bounced[0]))
    holding = next(p for p in objects if b'"status":"bounced"' in p.read_bytes() and bounced[0].encode() in p.read_bytes())
    assert holding == objects[-1], "the bounce came last"
    # One collect appends a shard's bounces as one object, so it may hold more than bounced[0];
    # the report names whichever of them it lists first.
    entries = [json.loads(line) for line in holding.read_bytes().splitlines()[1:]]
    lost = [e["ucc"] for e in entries if e["status"] == "bounced"]
    holding.unlink()  # the bounce object deleted before close: nothing links to it yet
    proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    found = verified(root, run_id)
    assert not found["ok"], found
    assert any(f"account {ucc} is 'bounced' in the report, 'delivered' in the delivery log" in found["first_problem"]
               for ucc in lost), (lost, found)


def test_a_proof_signed_again_with_a_key_of_one_s_own_fails_without_cert(closed_run, tmp_path, monkeypatch, capsys):
    settings, run_id, _, sealed, _ = closed_run
    root = copy(sealed, tmp_path / "store")
    make_test_certificate(tmp_path / "mine")
    mine = load_signer(str(tmp_path / "mine/signer.key.pem"), str(tmp_path / "mine/signer.cert.pem"), None)
    proof_key, sig_key = proof.proof_keys(run_id)
    (root / sig_key).write_bytes(detached.sign((root / proof_key).read_bytes(), mine))
    found = verified(root, run_id)
    assert not found["ok"] and "not by the run's signing certificate" in found["first_problem"], found
    (tmp_path / "not-a-cert.pem").write_text("hello")
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    capsys.readouterr()
    assert main(["verify", run_id, "--store", str(root), "--cert", str(tmp_path / "not-a-cert.pem")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --cert {tmp_path / 'not-a-cert.pem'}: not a PEM certificate"]


def test_a_timestamp_from_a_tsa_dates_the_seal_and_a_proof_made_again_fails_it(closed_run, tmp_path):
    settings, run_id, opened, _, _ = closed_run
    root = copy(opened, tmp_path / "store")
    url, tsa_cert, stop = servers.start_tsa(tmp_path / "tsa")
    try:
        proof.close(settings.__class__(**{**settings.__dict__, "tsa_url": url}), run_id,
                    now=after_the_window(settings, run_id), store_url=str(root))
    finally:
        stop()
    proof_key = proof.proof_keys(run_id)[0]
    stamped = verified(root, run_id, tsa_cert_pem=tsa_cert.read_bytes())
    assert stamped["ok"] and stamped["timestamp"]["time"] and "Time-Stamping" in stamped["timestamp"]["tsa"], stamped
    openssl = subprocess.run(["openssl", "ts", "-verify", "-data", str(root / proof_key), "-in",
                              str(root / proof.timestamp_key(run_id)), "-token_in", "-CAfile", str(tsa_cert)],
                             capture_output=True, text=True)
    assert openssl.returncode == 0 and "Verification: OK" in openssl.stdout, openssl.stderr
    # someone who holds the signing key seals again later: the proof's signature holds, its timestamp does not
    data = (root / proof_key).read_bytes().replace(b'"sealed_at": ', b'"sealed_at": 1', 1)
    (root / proof_key).write_bytes(data)
    (root / proof.proof_keys(run_id)[1]).write_bytes(detached.sign(data, load_signer(
        settings.signer_key, settings.signer_cert, None, settings.signer_chain)))
    resealed = verified(root, run_id)
    assert not resealed["ok"] and "the timestamp is not over this proof" in resealed["first_problem"], resealed
    (root / proof.timestamp_key(run_id)).unlink()  # what a close stopped before its timestamp leaves: not tampering
    begun = verified(root, run_id)
    assert begun["ok"] and exit_status(begun) == 3 and "not yet its timestamp" in begun["summary"], begun


def test_close_and_verify_on_s3_read_and_write_in_parallel_and_agree(ray_session, settings, day, s3_bucket,
                                                                    monkeypatch):
    """In a process per core, as on a day of 512 shards or more (record/spread.py), each with its
    own S3 client: what they read and write is the whole record, and an edit is still named."""
    monkeypatch.setattr(spread, "FROM_JOBS", 1)
    on_s3 = settings.__class__(**{**settings.__dict__, "store_url": f"s3://{s3_bucket}/record"})
    run_id = run_day(on_s3, RunRequest(TRADE_DATE, str(day)))["run_id"]
    sealed = proof.close(on_s3, run_id, now=after_the_window(on_s3, run_id))
    assert not sealed["already_sealed"] and sealed["shards"] > 1, sealed
    store = open_store(on_s3.store_url)
    found = verify(store, run_id)
    assert found["ok"] and found["sealed"] and found["log_objects"] == sealed["log_objects"], found
    listed = delivery_log.run_chain_keys(store, run_id)
    assert sum(map(len, listed.values())) == found["log_objects"] and len(listed) == found["shards"]
    edited = listed[max(listed)][0]
    store.put(edited, store.get(edited).replace(b'"at":1', b'"at":2', 1))
    assert verify(store, run_id)["first_problem"].startswith(f"{edited}: changed"), edited


def test_verify_on_s3_holds_the_archive_to_the_log_by_its_listing_and_reads_only_a_note_that_differs(
        ray_session, settings, day, s3_bucket):
    """The archive against the log at a broker's size: S3's listing gives each note's MD5 (its
    ETag), the log the MD5 and SHA-256 of what was mailed. Untouched, verify reads no note; a
    note replaced after mailing is named, and is the one note read. Before, verify read every
    archived note (1.5M GETs on a day)."""
    from pipeline.record.storage import S3Store

    on_s3 = settings.__class__(**{**settings.__dict__, "store_url": f"s3://{s3_bucket}/record"})
    run_id = run_day(on_s3, RunRequest(TRADE_DATE, str(day)))["run_id"]
    proof.close(on_s3, run_id, now=after_the_window(on_s3, run_id))
    notes_read = []

    class Counted(S3Store):
        def get(self, key: str) -> bytes:
            if "-signed-pdf/" in key:
                notes_read.append(key)
            return super().get(key)

    plain = open_store(on_s3.store_url)
    store = Counted(plain.url, plain.bucket, plain.prefix)
    found = verify(store, run_id)
    assert found["ok"] and found["sealed"], found
    assert notes_read == [], f"{len(notes_read)} notes read where the listing said each was what was mailed"
    mailed = sorted(e["ucc"] for e in delivery_log.entries(store, run_id) if e["status"] == "delivered")
    key = keys.signed_pdf_key(TRADE_DATE, mailed[len(mailed) // 2])
    boto3.client("s3").put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}",  # the bucket edited behind the run's back
                                  Body=store.get(key).replace(b"%%EOF", b"%%EOF\n% signed again", 1))
    notes_read.clear()
    found = verify(store, run_id)
    assert not found["ok"] and found["first_problem"].startswith(f"{key}: differs from what was mailed"), found
    assert notes_read == [key], notes_read


def test_a_note_s3_fails_to_give_is_not_called_removed_verify_could_not_run_exit_2(
        ray_session, settings, day, s3_bucket, s3_endpoint, monkeypatch, capsys):
    """Not read is not removed. A note whose listing gives no MD5 (S3 rewrote it in parts, as a
    replication or a copy does) is read; S3 failing that read (500, its retries spent) stops
    verify as a command that could not run (exit 2), which a script runs again. Before, any
    storage error on the read was taken for the note's absence: "removed from the archive after
    it was mailed", exit 1, the record read as tampered."""
    on_s3 = settings.__class__(**{**settings.__dict__, "store_url": f"s3://{s3_bucket}/record"})
    run_id = run_day(on_s3, RunRequest(TRADE_DATE, str(day)))["run_id"]
    store = open_store(on_s3.store_url)
    mailed = sorted(e["ucc"] for e in delivery_log.entries(store, run_id) if e["status"] == "delivered")
    key = keys.signed_pdf_key(TRADE_DATE, mailed[0])
    s3c, where = boto3.client("s3"), {"Bucket": s3_bucket, "Key": f"record/{key}"}
    upload = s3c.create_multipart_upload(**where, Metadata=s3c.head_object(**where)["Metadata"])["UploadId"]
    part = s3c.upload_part(**where, PartNumber=1, UploadId=upload, Body=store.get(key))["ETag"]
    s3c.complete_multipart_upload(**where, UploadId=upload, MultipartUpload={"Parts": [{"ETag": part, "PartNumber": 1}]})
    assert dict(store.md5s(keys.signed_pdf_prefix(TRADE_DATE, keys.partition(mailed[0]))))[key] == ""
    assert verify(store, run_id)["ok"], "read, it is the note mailed"
    proxy = servers.S3Between(s3_endpoint, faults={key: "refuse gets"})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        with pytest.raises(StorageError, match=f"cannot read '{key}': InternalError"):
            verify(open_store(on_s3.store_url), run_id)
        monkeypatch.setenv("REDIS_URL", settings.redis_url)
        assert main(["verify", run_id, "--store", on_s3.store_url]) == 2
        said = capsys.readouterr().err
        assert f"cannot read '{key}': InternalError" in said and "removed" not in said, said
    finally:
        proxy.stop()


def test_an_object_changed_in_the_bucket_with_its_metadata_kept_is_changed_exit_1_not_a_failed_read(
        ray_session, settings, day, s3_bucket, monkeypatch, capsys):
    """An editor that keeps an object's metadata (many S3 tools do) leaves its writer's CRC32
    on other bytes. Read twice (a transfer gone wrong is not the object), the object is changed:
    a note, "differs from what was mailed"; a delivery-log object or the report (read first when
    Redis forgot the run), "changed"; each exit 1. Before, the CRC32 refusal was a failed read:
    verify stopped, exit 2, and a script that runs it again on 2 never heard of the edit."""
    on_s3 = settings.__class__(**{**settings.__dict__, "store_url": f"s3://{s3_bucket}/record"})
    run_id = run_day(on_s3, RunRequest(TRADE_DATE, str(day)))["run_id"]
    store, s3c = open_store(on_s3.store_url), boto3.client("s3")
    monkeypatch.setenv("REDIS_URL", settings.redis_url)

    def edited(key: str, old: bytes, new: bytes) -> None:
        where = {"Bucket": s3_bucket, "Key": f"record/{key}"}
        kept = s3c.head_object(**where)["Metadata"]
        s3c.put_object(**where, Body=store.get(key).replace(old, new, 1), Metadata=kept)
        assert s3c.head_object(**where)["Metadata"] == kept

    mailed = sorted(e["ucc"] for e in delivery_log.entries(store, run_id) if e["status"] == "delivered")
    note = keys.signed_pdf_key(TRADE_DATE, mailed[0])
    edited(note, b"%%EOF", b"%%EOF\n% signed again")
    found = verify(store, run_id)
    assert found["first_problem"].startswith(f"{note}: differs from what was mailed"), found
    assert main(["verify", run_id, "--store", on_s3.store_url]) == 1
    log_object = delivery_log.run_chain_keys(store, run_id)[0][-1]
    edited(log_object, b'"at":1', b'"at":2')
    found = verify(store, run_id)
    assert found["first_problem"] == f"{log_object}: changed (not as it was written: its CRC32 is not its writer's)"
    assert main(["verify", run_id, "--store", on_s3.store_url]) == 1
    assert "changed (not as it was written" in capsys.readouterr().err
    report_key = keys.report_keys(run_id)[0]
    edited(report_key, b"}", b"} ")
    found = verify(store, run_id)  # the rest of the record checked too, as for a run with no report
    assert found["problems"][:2] == [f"{report_key}: changed (not as it was written: its CRC32 is not its writer's)",
                                     f"{log_object}: changed (not as it was written: its CRC32 is not its writer's)"]
    monkeypatch.setenv("REDIS_URL", settings.redis_url.rsplit("/", 1)[0] + "/13")  # a Redis that forgot the run:
    assert main(["verify", run_id, "--store", on_s3.store_url]) == 1  # the run located by its report
    assert f"{report_key}: changed (not as it was written" in capsys.readouterr().err


class _Unmade(Exception):
    """An error pickle cannot make again: its class takes two arguments, its args hold one."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


class _FailsElsewhere(FolderStore):
    """A folder store whose first read, in any process but the one that made it, ends that
    process ("end") or raises an error that process cannot send back whole ("unmade")."""

    def __init__(self, root: str, home: int, how: str):
        super().__init__(root)
        self.home, self.how = home, how

    def get(self, key: str) -> bytes:
        if os.getpid() != self.home:
            if self.how == "end":
                os._exit(3)
            raise _Unmade(key, "refused")
        return super().get(key)


def _size(store, key: str) -> int:
    return len(store.get(key))


def _children() -> set[psutil.Process]:
    """This process's own children: the session's Ray, Redis and S3 server are children too, and
    the workers Ray starts beside a test are its raylet's, not ours."""
    return set(psutil.Process().children())


def _spread_over(store, n: int = 400):
    for i in range(n):
        store.put(f"k/{i}", b"x" * i)
    return spread.each(_size, store, [(f"k/{i}",) for i in range(n)], n)


def test_the_processes_a_command_spreads_its_reads_over_are_all_it_starts(tmp_path, monkeypatch):
    """One a core but this one, and nothing else: multiprocessing's pool started its resource
    tracker as well, a process of 12 MB more in a command held to 200 MB."""
    monkeypatch.setattr(spread, "FROM_JOBS", 1)
    before = _children()
    sizes = _spread_over(FolderStore(str(tmp_path)))
    assert next(sizes) == 0
    assert len(_children() - before) == len(os.sched_getaffinity(0)) - 1
    assert list(sizes) == list(range(1, 400))
    assert _children() - before == set(), "each ended with the command's reads"


def test_a_process_that_ends_mid_slice_fails_the_command_naming_it_not_hanging(tmp_path, monkeypatch):
    monkeypatch.setattr(spread, "FROM_JOBS", 1)
    before = _children()
    with pytest.raises(StorageError, match=r"ended \(exit status 3\) before answering"):
        list(_spread_over(_FailsElsewhere(str(tmp_path), os.getpid(), "end")))
    assert _children() - before == set()



def test_an_error_a_spread_process_answers_with_that_cannot_be_made_again_fails_the_command_not_hanging(
        tmp_path, monkeypatch):
    """Before, the answer's unpickling raised in the reader thread, which ended: the slices it
    was to answer waited for ever, and so did the command."""
    monkeypatch.setattr(spread, "FROM_JOBS", 1)
    before, outcome = _children(), []

    def read() -> None:
        try:
            list(_spread_over(_FailsElsewhere(str(tmp_path), os.getpid(), "unmade")))
        except StorageError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the command hangs"
    assert outcome and "cannot read: TypeError" in outcome[0], outcome
    assert _children() - before == set()
