"""Every command the README and docs/ print works as printed (issue 71): each fenced block is
read out of its file and either typed into bash on a clean clone after the demo (class a),
parsed by the CLI that would run it, where it needs the cloud, `ray up`, AWS or a real HSM
(class b), or said to be no command (class c). A block added to a page and named in none of
CLASSIFIED fails `test_every_fenced_block_is_classified`, so a new one gets its test too.

The demo is made once for the module, from the README's own command, and the commands after it
(README, "After the demo") run in the folder it ran in; the instant seal makes its own demo, as
the README prints it."""

from __future__ import annotations

import csv
import json
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from pipeline.record import keys, report
from pipeline.settings import ROOT
from tests.doc_blocks import (a_reader_s_env, all_blocks, block, clean_clone, commands, pipeline_argvs, ray_argvs,
                              shown, typed)
from tests.helpers import assert_signed_and_encrypted, client_rows

# (page, a marker only that block holds, class, why, or which test runs it)
CLASSIFIED = [
    ("README.md", "-> split", "c", "the stages drawn, not a command"),
    ("README.md", "scripts/install.sh", "a", "its demo is the `demo` fixture's, as printed (with --bounce-rate, for "
                                             "`bounces` after it); install.sh's apt-get and venv are root-only "
                                             "system changes, run by tests/test_install.py"),
    ("README.md", "bash scripts/test.sh", "b", "the whole suite: a test cannot run the suite it is in; .ci/run "
                                               "runs it (checked: bash reads it, and .ci/run calls it)"),
    ("README.md", "source demo/env.sh", "a", "test_the_readme_s_after_the_demo_commands_work_as_printed"),
    ("README.md", "source demo-sealed/env.sh", "a", "test_the_readme_s_instant_seal_closes_and_verifies_at_once"),
    ("docs/aws.md", "put-object-lock-configuration", "b", "an S3 bucket with Object Lock in an AWS account (aws CLI)"),
    ("docs/aws.md", "secretsmanager create-secret", "b", "AWS Secrets Manager; `secret-json` is parsed"),
    ("docs/aws.md", "aws iam create-role", "b", "AWS IAM; the policy files it names are checked to exist"),
    ("docs/aws.md", "authorize-security-group-ingress", "b", "an EC2 security group in the broker's VPC; its ports "
                                                             "are checked against pipeline/tls/ports.py"),
    ("docs/aws.md", "ray up cluster.yaml", "b", "`ray up` on AWS; Ray's CLI and cluster_run.py's `run` parse them"),
    ("docs/aws.md", "ray job submit", "b", "a `ray up` head's dashboard tunnel; Ray's CLI and ours parse them"),
    ("docs/aws.md", "export CN_STORE=s3://YOUR-BUCKET", "b", "the day's S3 bucket and secret in AWS (tests/"
                                                             "test_ray_up.py follows it on a local cloud); parsed"),
    ("docs/aws.md", "cloudhsmv2 create-cluster", "b", "AWS CloudHSM, its cluster's CSR and initialization"),
    ("docs/aws.md", "libcloudhsm_pkcs11.so CN_PKCS11_PIN", "b", "CloudHSM's PKCS#11 library and Secrets Manager; "
                                                                "`secret-json` is parsed"),
    ("docs/aws.md", "from AWS's download page", "b", "cluster.yaml lines: root on a node, CloudHSM's package"),
    ("docs/aws.md", "signer_smtp:", "b", "cluster.yaml lines: root on a node, CloudHSM's package; `tls enroll` "
                                         "is parsed"),
    ("docs/aws.md", "genpkey -algorithm RSA", "a", "test_aws_md_s_dkim_key_and_its_txt_record_value"),
    ("docs/layout.md", "__main__ (the commands", "c", "the packages' map, not a command"),
    ("docs/operations.md", "ContractNotesDaySilent", "c", "a Prometheus rule, not a command (promtool checks it)"),
    ("docs/proof.md", "--imap 'imaps://", "b", "the broker's IMAPS bounce mailbox (tests/test_bounces.py reads a "
                                               "Dovecot one); parsed"),
    ("docs/proof.md", "openssl cms -verify", "a", "test_proof_md_s_openssl_check_of_the_seal"),
]
CLOUD = [(page, marker) for page, marker, kind, _ in CLASSIFIED if kind == "b"]


def test_every_fenced_block_is_classified():
    """A block no entry names, or an entry that names no block (or two), fails: each block of
    the README and docs/ is run, parsed, or said to be no command, with its reason."""
    found = all_blocks()
    named = {b: [e for e in CLASSIFIED if e[0] == b.page and e[1] in b.text] for b in found}
    unnamed = [str(b) for b, entries in named.items() if len(entries) != 1]
    assert not unnamed, f"fenced blocks in no class of CLASSIFIED (or in two): {unnamed}"
    stale = [e[:2] for e in CLASSIFIED if sum(e in entries for entries in named.values()) != 1]
    assert not stale, f"CLASSIFIED entries that name no block: {stale}"
    assert {e[2] for e in CLASSIFIED} <= {"a", "b", "c"}


# class a: typed as printed, on a clean clone


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return clean_clone(tmp_path_factory.mktemp("clone"))


@pytest.fixture(scope="module")
def demo(clone):
    """The README's demo, as its first block prints it, on the clean clone, with a bounce rate
    (the relay returns DSNs for 8% of the mail), so `bounces` after it has some to read. What the
    tests that follow it check against is kept as the demo left it."""
    [line] = commands(block("README.md", "scripts/install.sh").text)
    install, made = line.split(" && ")
    assert install == "bash scripts/install.sh" and " demo " in made, line
    env = a_reader_s_env()
    [(_, code, out)] = typed([made + " --bounce-rate 0.08"], env, clone, timeout=600)
    assert code == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    work = clone / made.split("--workdir ", 1)[1].split()[0]
    report_csv = work / "store" / keys.report_keys(summary["run_id"])[1]
    return {"clone": clone, "work": work, "env": env, "summary": summary,
            "statuses": {r["ucc"]: r["status"] for r in csv.DictReader(report_csv.open())},
            "paper": {r["ucc"] for r in csv.DictReader((work / "store" / report.paper_key(summary["run_id"])).open())},
            "outbox": len(list((work / "outbox").glob("*.eml")))}


def test_the_readme_s_demo_reports_exactly_the_accounts_the_relay_bounced_and_leaves_what_it_says(demo):
    """The README's demo, as a user runs it: the test relay accepts every message, then returns
    DSNs (half permanent, half delayed) to the VERP addresses; the demo reads them back. It
    prints the JSON line and leaves the files the README says to look at."""
    work, summary, statuses = demo["work"], demo["summary"], demo["statuses"]
    said = (Path(ROOT) / "README.md").read_text().split("The demo ends with one JSON line (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`(\w+)`", said)) <= set(summary), said
    notes = sorted(work.glob("store/*-signed-pdf/2026-11-20/*.pdf"))
    assert notes and list((work / "store" / "reports").iterdir()) and demo["outbox"] > 0
    # "password: the client's PAN, in demo/input/clients.csv"; "pdfsig shows the signature valid and the issuer
    # untrusted"; its certificate labelled "local test"
    clients = client_rows(work / "input")
    assert_signed_and_encrypted(notes[0], clients[notes[0].stem]["pan"])
    checked = subprocess.run(["pdfsig", "-upw", clients[notes[0].stem]["pan"], str(notes[0])], capture_output=True,
                             text=True).stdout
    assert "issuer isn't Trusted" in checked and "LOCAL TEST" in checked, checked
    sent = [json.loads(line) for line in (work / "bounces.jsonl").read_text().splitlines()]
    by_email = {c["email"]: u for u, c in clients.items()}
    expected = {by_email[s["rcpt"]]: s["kind"] for s in sent}
    assert 12 <= len(expected) <= 75, f"about 8% of {summary['accounts']}: {len(expected)}"
    assert {u: s for u, s in statuses.items() if s in ("bounced", "deferred")} == expected
    assert summary["bounces"]["refused"] == 0
    physical = {u for u, s in statuses.items() if s == "physical"}
    assert demo["paper"] == physical | {u for u, k in expected.items() if k == "bounced"}
    # the headline says it too (before: "delivered": 500, "physical": 0 while paper notes were owed)
    assert (summary["delivered"], summary["bounced"], summary["paper_owed"]) == (
        list(statuses.values()).count("delivered"), list(expected.values()).count("bounced"), len(demo["paper"]))


def test_the_readme_s_after_the_demo_commands_work_as_printed(demo):
    """README, "After the demo", typed as printed from the folder the demo ran in: each command
    works, `close` says the window is open and `verify` that the run is not sealed yet; then the
    clock past the bounce window, as close asks: it seals, and verify finds the record whole."""
    lines = commands(block("README.md", "source demo/env.sh").text)
    said = typed(lines, demo["env"], demo["clone"])
    exits = [code for _, code, _ in said]
    assert exits == [0, 0, 0, 0, 0, 2, 3, 0], shown(said)
    outs = {line.split(" $RUN_ID")[0].rsplit(" ", 1)[-1]: out for line, _, out in said}
    run_id = demo["summary"]["run_id"]
    assert re.search(rf"^run\s+{run_id}\b", outs["status"], re.M), outs["status"]
    assert last_json(outs["rerun"])["delivered_now"] == 1, outs["rerun"][-2000:]
    assert last_json(outs["bounces"])["refused"] == 0, outs["bounces"]
    assert "open until" in outs["close"] and "not sealed" in outs["verify"], outs["close"] + outs["verify"]
    assert len(list((demo["work"] / "outbox").glob("*.eml"))) == demo["outbox"] + 1, "the one client mailed again"
    past = [line for line in lines if line.startswith("source")] + [
        "faketime -f +73h " + line for line in lines if " close " in line or " verify " in line]
    sealed = typed([lines[0]] + past + [lines[-1]], demo["env"], demo["clone"])
    assert [code for _, code, _ in sealed] == [0, 0, 0, 0, 0], shown(sealed)
    assert last_json(sealed[-2][2])["sealed"] is True, sealed[-2][2]


def last_json(out: str) -> dict:
    """A command's result: its last line that is a JSON object (the logs share its output here)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


@pytest.fixture(scope="module")
def sealed(clone):
    """The README's instant seal, as printed, and with env.sh alone a test send through the
    demo's relay, signed with its token, before its services stop."""
    lines = commands(block("README.md", "source demo-sealed/env.sh").text)
    assert any("--bounce-window-h 0" in line for line in lines)
    lines.insert(-1, ".venv/bin/python -m pipeline test-send --to ops@broker.example.com")
    return lines, typed(lines, a_reader_s_env(), clone)


def test_the_readme_s_instant_seal_closes_and_verifies_at_once(sealed):
    """Before: CN_BOUNCE_WINDOW_H=0 was refused as out of range, after a half-made demo, and no
    supported way showed a sealed run; a test send asked for a key file, and env.sh named neither
    the relay nor the token."""
    lines, said = sealed
    assert [code for _, code, _ in said] == [0] * len(lines), shown(said)
    verified = next(out for line, _, out in said if " verify " in line)
    assert "sealed" in verified.lower() and "not sealed" not in verified.lower(), verified
    sent = next(out for line, _, out in said if " test-send " in line)
    assert '"status": "delivered"' in sent, sent


def test_proof_md_s_openssl_check_of_the_seal(sealed, clone, tmp_path):
    """docs/proof.md's `openssl cms -verify`, as printed, in a folder whose files have the names
    it uses: the sealed demo's proof, its signature and the chain of the key that signed it. A
    proof changed after signing fails the same command."""
    [command] = commands(block("docs/proof.md", "openssl cms -verify").text)
    env = dict(line.removeprefix("export ").split("=", 1) for line in (clone / "demo-sealed" / "env.sh")
               .read_text().splitlines() if line.startswith("export ") and "$(" not in line)
    run_id, reports = env["RUN_ID"], clone / "demo-sealed" / "store" / "reports"
    names = {"RUN.proof.p7s": reports / f"{run_id}.proof.p7s", "RUN.proof.json": reports / f"{run_id}.proof.json",
             "root.pem": Path(shlex.split(env["CN_SIGNER_CHAIN"])[0])}
    assert set(names) <= set(shlex.split(command)), command
    for name, source in names.items():
        (tmp_path / name).write_bytes(source.read_bytes())
    [(_, code, out)] = typed([command], a_reader_s_env(), tmp_path)
    assert code == 0 and "Verification successful" in out, out
    proof = (tmp_path / "RUN.proof.json").read_bytes()
    (tmp_path / "RUN.proof.json").write_bytes(proof.replace(b'"sha256": "', b'"sha256": "0', 1))
    [(_, code, out)] = typed([command], a_reader_s_env(), tmp_path)
    assert code != 0 and "Verification successful" not in out, out


def test_aws_md_s_dkim_key_and_its_txt_record_value(tmp_path):
    """docs/aws.md's DKIM key and the base64 of its public half, as printed: a 2048-bit RSA key
    that the mailers' DKIM signer takes, and the TXT record's p= it would publish."""
    from pipeline.mail.dkim_signer import dkim_from_pem, dns_record

    said = typed(commands(block("docs/aws.md", "genpkey -algorithm RSA").text), a_reader_s_env(), tmp_path)
    assert [code for _, code, _ in said] == [0, 0], shown(said)
    signer = dkim_from_pem((tmp_path / "dkim.key.pem").read_bytes(), "cn2026", "broker.example.com", "dkim.key.pem")
    assert signer.key.key_size == 2048
    assert dns_record(signer)[1].endswith(f"; p={said[1][2].strip()}"), said[1][2]


# class c, checked where a tool can: the Prometheus rule


def test_operations_md_s_prometheus_rule_is_one_promtool_takes_on_a_metric_the_day_counts(tmp_path):
    rule = block("docs/operations.md", "ContractNotesDaySilent").text
    (tmp_path / "rules.yml").write_text(rule)
    done = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    metric = re.search(r"absent_over_time\(ray_(\w+)\[", rule).group(1)
    assert f'Counter("{metric.removesuffix("_total")}"' in (Path(ROOT) / "actors" / "metrics.py").read_text(), metric


# class b: what this machine cannot run, parsed by the CLI that would run it


def parses(argv: list[str]) -> str:
    """"" if `python -m pipeline` takes these arguments, else what it said."""
    from pipeline.__main__ import _parser

    try:
        _parser().parse_args(argv)
    except SystemExit as e:
        return f"{argv}: exit {e.code}"
    return ""


def ray_parses(argv: list[str]) -> str:
    """"" if Ray's own CLI takes these arguments (its click commands, parsed, not run)."""
    from ray.scripts.scripts import cli

    try:
        ctx, command = cli.make_context("ray", list(argv)), cli
        while isinstance(command, click.Group):
            name, command, rest = command.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
            ctx = command.make_context(name, rest, parent=ctx)
    except click.ClickException as e:
        return f"ray {argv}: {e.format_message()}"
    return ""


def test_a_renamed_flag_fails_the_parse():
    assert parses(["rerun", "RUN_ID", "--failed"]) == "" and parses(["rerun", "RUN_ID", "--failures"])
    assert ray_parses(["job", "submit", "--no-wait", "--", "python", "x.py"]) == ""
    assert ray_parses(["job", "submit", "--nowait", "--", "python", "x.py"])


@pytest.mark.parametrize("page,marker", CLOUD, ids=[f"{p}:{m[:30]}" for p, m in CLOUD])
def test_each_command_of_a_block_this_machine_cannot_run_parses(page, marker):
    text = block(page, marker).text
    lines = commands(text)
    ours = [argv for line in lines for argv in pipeline_argvs(line)]
    rays = [argv for line in lines for argv in ray_argvs(line)]
    assert [parses(argv) for argv in ours if parses(argv)] == [], text
    assert [ray_parses(argv) for argv in rays if ray_parses(argv)] == [], text
    assert EXTRA[marker](lines) == (len(ours), len(rays)), (marker, ours, rays)


def _test_sh(lines):
    assert subprocess.run(["bash", "-n", lines[0].split()[1]], cwd=ROOT).returncode == 0
    assert lines[0] in (Path(ROOT) / ".ci" / "run").read_text()


def _iam(lines):
    roles = next(line for line in lines if line.startswith("for role in ")).split(" in ", 1)[1].split(";")[0].split()
    files = re.findall(r"file://(\S+)", " ".join(lines))
    assert roles and files and all((Path(ROOT) / f.replace("$role", r)).is_file() for f in files for r in roles)


def _security_group(lines):
    """The ports opened to the group are the port table's that the cluster's nodes reach."""
    from pipeline.tls import ports

    loop = next(line for line in lines if line.startswith("for ports in ")).split(" in ", 1)[1].split(";")[0]
    opened = {n for span in loop.split() for n in range(int(span.split("-")[0]), int(span.split("-")[-1]) + 1)}
    table = {n for p in ports.PORTS if p.peers in (ports.CLUSTER, ports.NODE_AND_HEAD)
             for n in range(p.first, p.last + 1)}
    assert opened == table, sorted(opened ^ table)[:20]


def _counted(ours: int, rays: int, check=None):
    def expect(lines):
        if check:
            check(lines)
        return ours, rays
    return expect


# what each block must hold (our commands, Ray's), and a check of its own where one fits
EXTRA = {
    "bash scripts/test.sh": _counted(0, 0, _test_sh),
    "put-object-lock-configuration": _counted(0, 0),
    "secretsmanager create-secret": _counted(1, 0),
    "aws iam create-role": _counted(0, 0, _iam),
    "authorize-security-group-ingress": _counted(0, 0, _security_group),
    "ray up cluster.yaml": _counted(1, 3),
    "ray job submit": _counted(2, 1),
    "export CN_STORE=s3://YOUR-BUCKET": _counted(2, 0),
    "cloudhsmv2 create-cluster": _counted(0, 0),
    "libcloudhsm_pkcs11.so CN_PKCS11_PIN": _counted(1, 0),
    "from AWS's download page": _counted(0, 0),
    "signer_smtp:": _counted(1, 0),
    "--imap 'imaps://": _counted(1, 0),
}


def test_every_flag_the_readme_s_commands_table_names_is_one_its_command_takes():
    """Not a fenced block, but the README's words too: a flag renamed in the code and not in the
    table (or the other way) fails here."""
    from pipeline.__main__ import _parser

    commands_ = next(a for a in _parser()._actions if a.dest == "command").choices
    table = (Path(ROOT) / "README.md").read_text().split("## Commands", 1)[1].split("\n\n", 2)[2].split("\n\n")[0]
    rows = [row.split(" | ")[0].lstrip("| ") for row in table.splitlines()[2:]]
    wrong = [(name, flag) for cell in rows for span in re.findall(r"`([^`]+)`", cell)
             for name in [span.split()[0]] for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)
             if name not in commands_ or flag not in commands_[name]._option_string_actions]
    assert len(rows) >= 15 and not wrong, wrong
