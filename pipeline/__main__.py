"""python -m pipeline: the commands. Run `python -m pipeline --help`.

Every command reads the same settings (pipeline/settings.py, from environment variables);
command-line flags override them. Commands that run the job print one JSON object on stdout,
and nothing else: logs, progress and what Ray prints go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import subprocess
import os
import secrets
import signal
import sys
from pathlib import Path

from pipeline.errors import CannotRun
from pipeline.settings import DEFAULT_KEY_DIR, PLACEHOLDER_OWNER_PASSWORD, ConfigError, Settings

log = logging.getLogger("pipeline")
COMMANDS: list[tuple[str, str, tuple, object]] = []  # name, help, arguments, function: in --help's order


def command(name: str, help: str, *arguments):
    """A command's name, help and arguments, declared above its function: one place to read it."""
    def register(func):
        COMMANDS.append((name, help, arguments, func))
        return func
    return register


def arg(*flags, **options) -> tuple:
    return flags, options


def one_of(*arguments, required: bool = True) -> tuple:
    """Arguments of which exactly one is given."""
    return "one_of", {"arguments": arguments, "required": required}


# The commands whose INFO lines are their progress, shown by default; the others say only their
# result, or one line of error, unless --verbose
PROGRESS = {"run", "rerun", "demo", "serve", "tls", "watch", "test-send"}


def main(argv: list[str] | None = None, stdout=None) -> int:
    args = _parser().parse_args(argv)
    args.stdout = stdout or sys.stdout
    level = logging.INFO if args.verbose or args.command in PROGRESS else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for chatty in ("pikepdf", "botocore"):  # "logger bridge initialized", "Found credentials": no news to anyone
        logging.getLogger(chatty).setLevel(logging.WARNING)
    logging.getLogger("pipeline.followup.located.store").setLevel(logging.INFO)  # which store, and why: always said
    try:
        return args.func(args)
    except Exception as e:
        import redis

        from botocore.exceptions import BotoCoreError, ClientError

        from pipeline.record.waiting import RedisGone

        cause = getattr(e, "cause", None) or e  # a Ray task's error carries the original as its cause
        if not isinstance(cause, (CannotRun, redis.ConnectionError, BotoCoreError, ClientError)):  # pipeline/errors.py
            raise
        log.debug("the run could not start", exc_info=True)
        said = f"{cause}: once it is back, run the same run id again (what was delivered is skipped)" \
            if isinstance(cause, RedisGone) else \
            f"Redis cannot be reached ({cause}): is it running, and is REDIS_URL right?" \
            if isinstance(cause, redis.ConnectionError) else \
            f"S3 storage: {cause}" if isinstance(cause, (BotoCoreError, ClientError)) else cause
        print(f"error: {said}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """A wrong argument is one line, as every error here: argparse's usage block is --help's."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pipeline", description=(
        "Contract notes on Ray: trade dumps in, signed and e-mailed contract notes out. "
        "Settings come from environment variables (CN_STORE, REDIS_URL, SMTP_URL, CN_SHARD_SIZE, "
        "CN_WINDOW, CN_SIGNERS, CN_MAILERS, CN_SIGNER_KEY, CN_SIGNER_CERT, CN_OWNER_PASSWORD, ...; "
        "docs/settings.md lists them, `config` shows them as this shell has them); flags override them."),
        epilog="Exit status of run, rerun and demo: 0 every account delivered (or sent to physical dispatch), "
               "1 some accounts failed, were rejected or are unconfirmed (the report names each), 2 the run could "
               "not start (input, storage, Redis, settings or calendar) or had to stop (Redis lost the run's "
               "state): one line on stderr, 'error: ...'.")
    p.add_argument("--version", action=_Version, nargs=0, help="print the release and commit, then exit")
    verbose = _Parser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true",
                         help="the INFO lines too (run, rerun, demo, serve, tls, watch and test-send show them anyway)")
    sub = p.add_subparsers(required=True, metavar="COMMAND", dest="command")
    for name, help, arguments, func in COMMANDS:
        c = sub.add_parser(name, help=help, parents=[verbose])
        for flags, options in arguments:
            if flags == "one_of":
                group = c.add_mutually_exclusive_group(required=options["required"])
                for inner, opts in options["arguments"]:
                    group.add_argument(*inner, **opts)
            else:
                c.add_argument(*flags, **options)
        c.set_defaults(func=func)
    return p


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(_version(), file=sys.__stdout__)  # stdout itself: the JSON's stream, whatever stdout was pointed at
        parser.exit()


def _version() -> str:
    """The release, and the commit when this is a git checkout (what a bug report needs)."""
    from pipeline import __version__
    from pipeline.settings import ROOT

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"contract-notes-on-Ray {__version__}" + (f" (commit {commit})" if commit else "")


def _run_id(text: str) -> str:
    from pipeline.record.keys import check_run_id

    try:
        return check_run_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD)") from None


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share from 0 to 1")
    return value


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of accounts (1 or more)")
    return n


def _window_h(text: str) -> float:
    try:
        hours = float(text)
    except ValueError:
        hours = -1.0
    if not 0 <= hours <= 720:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours from 0 to 720")
    return hours


def _accounts(text: str) -> list[str]:
    """Comma-separated codes, or "-": the codes on standard input, one a line or comma-separated."""
    if text == "-":
        text = sys.stdin.read().replace("\n", ",")
    accounts = [a.strip() for a in text.split(",") if a.strip()]
    if not accounts:
        raise argparse.ArgumentTypeError("give at least one account")
    return accounts


STORE_HELP = ("where the run's record is, when Redis does not hold the run (default: the store the run recorded, "
              "else CN_STORE); a store other than the recorded one is used only if it holds the run's manifest")
STORE = arg("--store", help=STORE_HELP)
RUN_ID = arg("run_id", type=_run_id)
ADDRESS = arg("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
PIN_CORRECTED = arg("--pin-corrected", action="store_true",
                    help="the HSM refused the PIN before and it has been corrected: offer it once more")


@command("synth", "write synthetic clients.csv, trades.csv, bhavcopy.csv and reference_rates.csv for a trade date",
         arg("--date", required=True, type=_date), arg("--accounts", required=True, type=_positive),
         arg("--out", required=True, type=Path), arg("--seed", type=int, default=1),
         arg("--volatile", action="store_true", help="add one client with 60,000 trades (~2000 pages)"),
         arg("--segment-share", type=_share, default=0.1,
             help="the share of clients who also trade currency, commodities and BSE index options (0 to 1)"))
def cmd_synth(args) -> int:
    from pipeline.day.synth import SynthOptions, write_dumps

    options = SynthOptions(args.date, args.accounts, args.seed, args.volatile, segment_share=args.segment_share,
                           holidays_file=os.environ.get("CN_HOLIDAYS_FILE", ""))
    clients, trades = write_dumps(args.out, options)
    print(json.dumps({"clients": str(clients), "trades": str(trades), "bhavcopy": str(args.out / "bhavcopy.csv"),
                      "reference_rates": str(args.out / "reference_rates.csv"),
                      "accounts": args.accounts}), file=args.stdout)
    return 0


@command("run", "the real job: one trade date's dumps to delivered contract notes",
         arg("--date", required=True, type=_date),
         arg("--input", required=True, help="folder or s3://bucket/prefix holding clients.csv, trades.csv and "
                                            "bhavcopy.csv (and reference_rates.csv for cross-currency pairs)"),
         arg("--store", help="folder or s3://bucket[/prefix] (default: CN_STORE)"),
         arg("--redis", help="redis://host:port/db (default: REDIS_URL)"),
         arg("--smtp", help="smtp://[user:pass@]host:port or smtps://... (default: SMTP_URL)"),
         arg("--run-id", type=_run_id,
             help="a run id to resume: delivered accounts are skipped ([A-Za-z0-9._-]{1,64})"),
         ADDRESS,
         arg("--deadline-min", type=float, help="the run's deadline, in minutes from now: until then an HSM, relay "
                                                "or Redis outage holds the day (CN_DEADLINE_AT); on a cluster the "
                                                "autoscaler is asked for what it needs"),
         arg("--keep-cluster", action="store_true", help="on a cluster: do not tear it down at the end"),
         arg("--test-keys", action="store_true",
             help="a test run: accept the public placeholder owner password when CN_OWNER_PASSWORD is unset"),
         arg("--accept-volatile-redis", action="store_true",
             help="run although Redis keeps nothing on disk (no AOF, no snapshots): a Redis restart then "
                  "stops the run, and the same run id must be run again"),
         PIN_CORRECTED)
def cmd_run(args) -> int:
    """The day, beating CN_HEARTBEAT_URL while it runs (a monitor pages when the beat stops: a
    dead head or driver tells no hook), and then its end told to CN_ON_END and the heartbeat:
    the summary with the exit status, or the one-line reason it could not run."""
    from pipeline.cluster.end_hook import notify
    from pipeline.cluster.heartbeat import beating

    settings = Settings.from_env()
    with beating(settings.heartbeat_url, settings.heartbeat_s) as beat:
        try:
            summary = _run(args)
        except Exception as e:
            notify(settings.on_end, {"command": "run", "date": args.date.isoformat(), "run_id": args.run_id or "",
                                     "exit_status": 2, "error": str(getattr(e, "cause", None) or e).splitlines()[0][:500]})
            raise
        status = _exit_status(summary)
        if beat:
            beat.end(status == 0, f"run {summary['run_id']}: exit status {status}")
    late = bool(args.deadline_min) and summary["elapsed_s"] > args.deadline_min * 60
    notify(settings.on_end, {"command": "run", **summary, "exit_status": status, "late": late})
    return status


def _run(args) -> dict:
    from actors import metrics
    from pipeline import credentials
    from pipeline.cluster.driver import RunRequest, new_run_id, preflight, run_day
    from pipeline.cluster.plan import on_cluster, session
    from pipeline.record import made_with
    from pipeline.record.lease import held
    from pipeline.record.state import RunState

    # on a cluster, whatever stops the day (a wrong input URL included) ends the cluster too
    with session(on_cluster(), args.deadline_min, args.keep_cluster) as current:
        given = Settings.from_env(store_url=args.store, redis_url=args.redis,
                                  smtp_url=args.smtp).with_deadline(args.deadline_min)
        if credentials.owner_password(given) == PLACEHOLDER_OWNER_PASSWORD and not args.test_keys:  # before any file
            raise ConfigError("CN_OWNER_PASSWORD is not set: the placeholder owner password is public, so anyone "
                              "could lift the notes' permissions; set it, or pass --test-keys for a test run")
        settings = _on_redis(_with_test_key_if_default(given, DEFAULT_KEY_DIR)).anchored()
        _pin_corrected(settings, args.pin_corrected)
        # The secret's values are checked here and read again by each actor: they never travel through Ray
        resolved = credentials.resolve(settings)
        resolved.hmac_key()  # a secret made before the VERP addresses has no token_key: said now, not by each mailer
        current.relay_rate, current.hsm_rate = resolved.relay_rate(), resolved.hsm_ops_s
        request = RunRequest(args.date.isoformat(), args.input, args.run_id or new_run_id(args.date.isoformat()))
        if args.run_id:
            settings = made_with.resumed(settings, request.run_id)  # a resumed run's own
            if args.smtp:  # else the driver mails through the relays the run recorded, as `rerun` does
                request = dataclasses.replace(request, relays=settings.relays())
        else:  # a new run's are all the shell's: a name mistyped is said now, not at its first rerun
            made_with.shell_settings(settings)
        checked = preflight(settings, request, request.run_id, require_persistence=not args.accept_volatile_redis)
        state = RunState(settings.redis_url, request.run_id, settings.state_ttl_s)
        # the run's lease before Ray starts: a second driver on the run id stops at once, naming the first
        with held(state, settings.lease_s) as lease:  # Ray starts in run_day, while its first notes are made
            summary = run_day(settings, request, current.size_for, current.watch, lease=lease, address=args.address,
                              checked=checked)
    if on_cluster():  # the head's metrics port is where the day's totals are read
        metrics.wait_exported()
    print(json.dumps(summary), file=args.stdout)
    return summary


def _with_test_key_if_default(settings: Settings, key_dir: Path, force: bool = False) -> Settings:
    """With no signing key configured, make a clearly labelled local test certificate once."""
    from pipeline.seal.sign import make_test_certificate

    if (force or settings.uses_default_key()) and not Path(settings.signer_key).exists():
        log.warning("no signing key configured: generating a LOCAL TEST certificate in %s "
                    "(not valid for real contract notes; set CN_SIGNER_KEY/CN_SIGNER_CERT)", key_dir)
        make_test_certificate(key_dir)
    return settings


def _pin_corrected(settings: Settings, corrected: bool) -> None:
    from pipeline import credentials

    if corrected and settings.pkcs11_module and credentials.pin_corrected(settings):
        log.info("the HSM's refusal of the PIN for token %r is forgotten: the PIN is offered once more",
                 settings.pkcs11_token)


def _on_redis(settings: Settings) -> Settings:
    """With the secret's Redis password when REDIS_URL names the head's user `cn` without one."""
    from pipeline.credentials import with_redis_password

    return with_redis_password(settings)


@command("plan", "node counts, split, report, head and expected duration for a day (the driver's own sizing), "
                 "from the rates in pipeline/cluster/measured.json",
         arg("--accounts", type=_positive), arg("--deadline-min", type=float, default=25.0),
         arg("--rows", type=int, help="the day's client and trade rows (default: accounts x the benchmark "
                                      "day's rows per account)"),
         arg("--render-nodes", type=int, default=1, help="at least this many render nodes (e.g. 4: 128 vCPU)"),
         arg("--table", action="store_true", help="print the capacity table of docs/aws.md instead"))
def cmd_plan(args) -> int:
    from pipeline.cluster.plan import capacity_table, plan

    if args.table:
        if args.accounts is not None:
            raise SystemExit("error: --table prints the table for every size of day: give --accounts or --table")
        print(capacity_table(args.deadline_min), file=args.stdout)
        return 0
    if args.accounts is None:
        raise SystemExit("error: plan needs --accounts N (or --table)")
    settings = Settings.from_env()
    p = plan(args.accounts, args.deadline_min, rows=args.rows, retention_days=settings.state_ttl_s / 86400,
             min_render_nodes=args.render_nodes, relay_rate=settings.relay_rate(),
             hsm_rate=settings.hsm_ops_s).as_dict()
    print(f"{p['render_nodes']} x {p['render_instance']} (render) + {p['signer_smtp_nodes']} x "
          f"{p['signer_smtp_instance']} (signer/SMTP), head {p['head_instance']} ({p['head_kept_instance']} if "
          f"kept for the retention): the split of {p['rows']:,} rows {p['split_min']} min, about "
          f"{p['expected_min']} min in all, ~${p['est_cost_usd_on_demand']} on demand",
          file=sys.stderr)
    print(p["advice"] or ("the relays' rate: " + (f"{p['relay_rate']:g}/s, not the bottleneck" if p["relay_rate"] else
                          "not known (give each relay in SMTP_URL a ?rate=)")), file=sys.stderr)
    print(json.dumps(p), file=args.stdout)
    return 0 if p["fits_deadline"] else 1


@command("rerun", "rerun the failed or the named accounts of a run, from where each stopped",
         RUN_ID,
         one_of(arg("--failed", action="store_true", help="every account in the run's failed registry"),
                arg("--unconfirmed", action="store_true",
                    help="every unconfirmed account, mailed again with the same Message-ID (reconcile first)"),
                arg("--accounts", type=_accounts,
                    help="comma-separated client codes (UCC), or - to read them from standard input")),
         arg("--force", action="store_true", help="mail again accounts already delivered"),
         arg("--smtp", help="mail through this relay, smtp://[user:pass@]host:port (default: the run's own "
                            "relays, as it recorded them; not SMTP_URL)"),
         ADDRESS, STORE, PIN_CORRECTED)
def cmd_rerun(args) -> int:
    from pipeline import credentials
    from pipeline.cluster.driver import rerun, undone
    from pipeline.errors import RunNotFound

    settings = _on_redis(Settings.from_env(smtp_url=args.smtp).with_deadline())
    _pin_corrected(settings, args.pin_corrected)
    if args.smtp:
        credentials.check_relay_logins(settings)
    try:
        summary = rerun(settings, args.run_id, args.accounts, args.failed, args.force, args.unconfirmed,
                        settings.relays() if args.smtp else None, args.store, args.address)
    except RunNotFound as e:
        return _not_found(args, e)
    print(json.dumps(summary), file=args.stdout)
    # the accounts it took, not the run's others: those still failed or unconfirmed are another rerun's; and
    # with --force, a delivered account's new mail that failed or was left unanswered (it stays delivered)
    return 1 if undone(summary) else 0


def _not_found(args, e: Exception) -> int:
    """One line on stderr, as every exit 2; the same as JSON on stdout where the tools read JSON:
    with --json, and from rerun and reconcile, whose result is always JSON."""
    print(f"error: {e}", file=sys.stderr)
    if getattr(args, "json", args.command in ("rerun", "reconcile")):
        print(json.dumps({"error": str(e)}), file=args.stdout)
    return 2


def _exit_status(summary: dict) -> int:
    """0 only when every account has its note's outcome: one left pending (its chain failed where
    its accounts could not be read back to fail them, say S3 out past the deadline) was never mailed."""
    return 0 if not (summary["failed"] or summary.get("rejected") or summary.get("unconfirmed")
                     or summary.get("pending")) else 1


@command("reconcile", "mark unconfirmed accounts delivered where the relay's log shows their Message-ID "
                      "accepted (Postfix, Haraka, or a plain list of Message-IDs)",
         RUN_ID, arg("--relay-log", type=Path, nargs="+", required=True, metavar="FILE"), STORE)
def cmd_reconcile(args) -> int:
    from pipeline.errors import RunNotFound
    from pipeline.followup.reconcile import reconcile

    missing = [str(p) for p in args.relay_log if not p.is_file()]
    if missing:
        raise ConfigError(f"relay log not found: {', '.join(missing)}")
    try:
        summary = reconcile(_on_redis(Settings.from_env()), args.run_id, args.relay_log, args.store)
    except RunNotFound as e:
        return _not_found(args, e)
    print(json.dumps(summary), file=args.stdout)
    return 0 if summary["still_unconfirmed"] == 0 else 1


@command("bounces", "record the bounces that came back to a run's VERP addresses: bounced (paper owed) or "
                    "deferred; from IMAP, a maildir or an mbox",
         RUN_ID,
         arg("--imap", action="append", default=[], metavar="URL",
             help="imaps://user:password@host[:port]/FOLDER (the bounce domain's mailbox)"),
         arg("--maildir", action="append", default=[], metavar="DIR"),
         arg("--mbox", action="append", default=[], metavar="FILE"),
         arg("--watch", action="store_true", help="keep reading, every --every seconds, until stopped"),
         arg("--every", type=float, default=30.0, metavar="S"), STORE)
def cmd_bounces(args) -> int:
    from pipeline.followup.bounces import collect
    from pipeline.cluster.plan import on_cluster

    sources = args.imap + args.maildir + args.mbox
    if not sources:
        raise ConfigError("bounces needs at least one --imap, --maildir or --mbox")
    settings = _on_redis(Settings.from_env())
    count, stopped = (lambda kind, n: None), []
    if on_cluster():  # ray_cn_bounces_total{kind}, on the head's metrics port, beside the day's counters
        import ray

        from actors import metrics

        ray.init(address="auto", log_to_driver=False)  # before the handlers below: it sets its own for SIGTERM
        count = metrics.bounces
    if args.watch:  # stopped as a service is (SIGTERM) or by hand (Ctrl-C): the same clean end, once what it read is recorded
        def stop(signum, frame) -> None:
            if stopped:  # asked twice: at once
                raise KeyboardInterrupt
            stopped.append(signum)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    try:
        summary = collect(settings, args.run_id, sources, args.watch, args.every, count, args.store,
                          lambda: bool(stopped))
        print(json.dumps(summary), file=args.stdout)
    finally:
        if on_cluster():
            metrics.wait_exported()
    return 0


@command("close", "once the run's bounce window has passed (CN_BOUNCE_WINDOW_H): every mailed account with no "
                  "bounce is delivered, final; the delivery log is sealed with a signed proof",
         RUN_ID, STORE)
def cmd_close(args) -> int:
    from pipeline.followup.close import close

    print(json.dumps(close(_on_redis(Settings.from_env()), args.run_id, store_url=args.store)), file=args.stdout)
    return 0


@command("verify", "check a run's delivery log, proof, signature and timestamp from storage alone, and its report "
                   "against the log: exit 0 sealed and whole; 1 naming the first object changed, removed, out of "
                   "place or disagreeing; 2 the store could not be read; 3 not sealed yet (or its close began: the next "
                   "close finishes it)",
         RUN_ID,
         arg("--cert", type=Path, help="the broker's signing certificate (PEM): the proof must be signed by it "
                                       "(default: the certificate the run recorded when it started)"),
         arg("--tsa-cert", type=Path, help="the time-stamping authority's certificate (PEM): the proof's "
                                           "timestamp must be signed by it"),
         STORE)
def cmd_verify(args) -> int:
    from pipeline.followup.located import locate
    from pipeline.followup.verify import exit_status, verify

    cert, tsa_cert = _certificate(args.cert, "--cert"), _certificate(args.tsa_cert, "--tsa-cert")
    found = locate(_on_redis(Settings.from_env()), args.run_id, args.store, command="verify", redis_optional=True,
                   sealed_is_found=True)
    result = verify(found.store, args.run_id, cert, tsa_cert)
    print(result["summary"], file=sys.stderr)
    print(json.dumps({**result, "store": found.store.url, "store_from": found.source}), file=args.stdout)
    return exit_status(result)


def _certificate(path: Path | None, flag: str) -> bytes | None:
    """The PEM certificate a flag names, or one line saying why it is not one."""
    from pipeline.seal import detached
    from pipeline.seal.signer import SignError

    if path is None:
        return None
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    pem = path.read_bytes()
    try:
        detached.fingerprint(pem)
    except SignError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    return pem


@command("status", "one run at a glance: its accounts by status, paper owed, relay, times, bounce window and what "
                   "to do next (--json: the same for scripts, in one shape from Redis or storage)",
         RUN_ID, STORE, arg("--json", action="store_true"))
def cmd_status(args) -> int:
    """From Redis while the run is live; from its report in storage once Redis is gone (the
    cluster's Redis ends with the cluster; the report is the record)."""
    from pipeline.errors import RunNotFound
    from pipeline.followup import status
    from pipeline.followup.located import locate
    from pipeline.followup.seal_state import seal_state
    from pipeline.record import rates
    from pipeline.record.keys import report_keys
    from pipeline.record.report import read_report
    from pipeline.record.state import RunState

    settings = _on_redis(Settings.from_env())
    try:  # a status is asked now: a Redis that does not answer at once is passed over for storage
        found = locate(settings, args.run_id, args.store, command="status", redis_optional=True)
    except RunNotFound as e:
        return _not_found(args, e)
    where = {"store": found.store.url, "store_from": found.source}
    seal = seal_state(found.store, args.run_id).state  # a close that began shows there before Redis hears of it
    if found.in_redis:
        state = RunState(settings.redis_url, args.run_id, patience_retries=0)
        meta = state.meta()
        run = status.from_redis(args.run_id, where, meta, state.counts(), state.final_counts(meta),
                                rates.snapshot(state.r), seal)
    else:
        key = report_keys(args.run_id)[0]
        if not found.store.exists(key):
            return _not_found(args, RunNotFound(f"run {args.run_id}: {found.store.url} holds its manifest but no "
                                                "report yet (the run has not finished), and Redis does not hold it"))
        run = status.from_report(args.run_id, where, read_report(found.store, key), seal)
    print(json.dumps(run) if args.json else status.table(run), file=args.stdout)
    return 0


@command("watch", "on the laptop: follow a day's Ray job (`ray job submit --no-wait`'s id) and, if its address stops "
                  "answering, ask the cloud: a head it still runs is a dropped tunnel (said; the watch goes on), one "
                  "it no longer runs is lost (said in one line with the run id that resumes it, exit 3); an address "
                  "that never answered is said as such (exit 4)",
         arg("job_id", help="the job's submission id"),
         arg("--address", default="http://127.0.0.1:8265", help="the Ray dashboard (`ray dashboard`'s tunnel)"),
         arg("--silence-s", type=float, default=30.0, help="how long the address may not answer before the cloud "
                                                           "is asked"),
         arg("--cluster-config", default="cluster.yaml", help="the cluster's config, whose node provider says "
                                                              "whether the head instance runs"))
def cmd_watch(args) -> int:
    from pipeline.cluster.watch import head_state, watch

    return watch(args.address.rstrip("/"), args.job_id, args.silence_s, out=args.stdout,
                 cloud=lambda: head_state(args.cluster_config))


@command("test-send", "render, sign and mail one note (a synthetic client's, or --input's first) to an address you "
                      "name, outside any run: the template, key, owner password and relay proved before a day",
         arg("--to", required=True, help="the address that gets the note"),
         arg("--date", type=_date, default=dt.date(2026, 11, 20), help="the note's trade date (a trading day)"),
         arg("--input", default="", help="a day's input folder or s3:// prefix: its first client, not a synthetic one"),
         arg("--smtp", help="the relay, smtp[s]://[user:pass@]host:port (default: SMTP_URL)"))
def cmd_test_send(args) -> int:
    from pipeline.cluster.test_send import test_send

    settings = _on_redis(Settings.from_env(smtp_url=args.smtp))
    sent = test_send(settings, args.to, args.date.isoformat(), args.input)
    print(json.dumps(sent), file=args.stdout)
    return 0 if sent["status"] == "delivered" else 1


@command("logs", "the driver's log of a run, from storage (kept beside its record while the day runs, and after "
                 "the cluster is gone); PANs and e-mail addresses masked", RUN_ID,
         arg("--follow", "-f", action="store_true",
             help="print each new part as it comes, until the log says the run's last driver (a rerun's too) ended"),
         arg("--silence-s", type=float, default=180.0, metavar="S",
             help="with --follow: a driver that wrote nothing for S seconds and no end is gone (killed, its host "
                  "lost): said in one line, exit 3 (a live one writes at least once a minute)"),
         STORE)
def cmd_logs(args) -> int:
    from pipeline.errors import RunNotFound
    from pipeline.followup.located import locate
    from pipeline.record import run_log

    settings = _on_redis(Settings.from_env())
    try:
        found = locate(settings, args.run_id, args.store, command="logs", redis_optional=True)
    except RunNotFound as e:
        return _not_found(args, e)
    chunks = run_log.follow(found.store, args.run_id, silence_s=args.silence_s) if args.follow else \
        (text for _, text in run_log.read(found.store, args.run_id))
    shown = 0
    try:
        for text in chunks:
            print(text, end="", file=args.stdout, flush=True)
            shown += 1
    except run_log.DriverGone as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if not shown:
        raise RunNotFound(f"run {args.run_id}: {found.store.url} holds no log for it (a run before logs were kept, "
                          "or one refused before it started)")
    return 0


@command("runs", "the runs in the store, newest first: date, accounts, delivered, failed, unconfirmed, bounced, "
                 "rejected, paper notes owed, sealed or not, start, duration and state (running, finished, closing, "
                 "sealed), from storage, a run Redis holds as Redis has it", STORE, arg("--json", action="store_true"))
def cmd_runs(args) -> int:
    from pipeline.followup.runs import list_runs, live, table
    from pipeline.record.storage import open_store

    settings = Settings.from_env()
    url = args.store or settings.store_url
    if "://" not in url and not Path(url).is_dir():
        raise ConfigError(f"no store at {url}: no such folder (CN_STORE, or --store)")
    rows = list_runs(open_store(url, probe=True))
    try:
        rows = live(rows, _on_redis(settings).redis_url)
    except ConfigError as e:  # the secret's Redis password out of reach: the runs as storage has them
        log.warning("runs as storage has them: %s", e)
    if not rows:
        raise ConfigError(f"no runs in {url}: it holds no run's manifest or report")
    print(json.dumps(rows) if args.json else table(rows), file=args.stdout)
    return 0


@command("config", "every setting as this shell would run with it: its value (secrets masked) and whether it "
                   "came from the environment or is the default", arg("--json", action="store_true"))
def cmd_config(args) -> int:
    from pipeline.settings import effective

    rows = effective()
    if args.json:
        print(json.dumps(rows), file=args.stdout)
        return 0
    width = max(len(r["setting"]) for r in rows)
    for r in rows:
        print(f"{r['setting']:<{width}}  {r['value']:<40}  {r['from']}", file=args.stdout)
    return 0


@command("secret-json", "print the cluster secret (CN_SECRET's JSON) made from CN_SIGNER_KEY, CN_SIGNER_CERT, "
                        "CN_SIGNER_CHAIN, CN_OWNER_PASSWORD, SMTP_URL and CN_DKIM_KEY")
def cmd_secret_json(args) -> int:
    from pipeline.credentials import secret_json

    settings = Settings.from_env()
    if settings.owner_password == PLACEHOLDER_OWNER_PASSWORD:
        raise ConfigError("CN_OWNER_PASSWORD is not set: the secret needs the broker's own owner password")
    print(secret_json(settings), file=args.stdout)
    return 0


@command("redis-acl", "print the head's Redis users (an aclfile) from CN_SECRET's redis_password: "
                      "cluster.yaml's head_setup_commands")
def cmd_redis_acl(args) -> int:
    from pipeline.credentials import fetch
    from pipeline.record.redis_acl import acl_file
    from pipeline.credentials import render_redis_password

    settings = Settings.from_env()
    password = fetch(settings.secret).get("redis_password") if settings.secret else None
    if not password:
        raise ConfigError(f"CN_SECRET={settings.secret!r}: redis-acl needs the secret's redis_password "
                          "(python -m pipeline secret-json makes one)")
    print(acl_file(password, render_redis_password(password)), end="", file=args.stdout)
    return 0


@command("tls", "the cluster's own CA and ports (cluster.yaml): `init` on the head makes the CA and the head's "
                "certificate, `serve` issues the workers theirs, `enroll HEAD_IP` gets a worker's, in CN_TLS_DIR "
                "(default ~/.cn-tls); `firewall [HEAD_IP]` prints the node's iptables rules (pipeline/tls/ports.py)",
         arg("action", choices=["init", "serve", "enroll", "firewall"]),
         arg("head", nargs="?", help="enroll, and a worker's firewall: the head's IP"),
         arg("--ip", help="init: the head's IP (default: the one Ray uses)"),
         arg("--port", type=int, help="the head's certificate service (default 6381)"),
         arg("--token-file", type=Path, default=Path.home() / ".ray/auth_token",
             help="the cluster's Ray token, which proves both sides"))
def cmd_tls(args) -> int:
    """The cluster's CA and certificates (pipeline/tls/ca.py, enroll.py): cluster.yaml's setup."""
    from pipeline.tls import ca as tls_ca, enroll

    if args.action == "firewall":
        from pipeline.tls.ports import firewall

        print(firewall(args.head or "127.0.0.1"), end="", file=args.stdout)
        return 0
    folder = Path(Settings.from_env().tls_dir or Path.home() / ".cn-tls").expanduser()
    if args.action == "init":
        from ray.util import get_node_ip_address

        ip = args.ip or get_node_ip_address()
        made = tls_ca.init_head(folder, ip)
        log.info("%s the cluster's CA in %s; the head's certificate for %s", "made" if made else "kept", folder, ip)
    elif args.action == "serve":
        from functools import cache

        from pipeline.cluster.plan import BOOTSTRAP_CONFIG, node_ips, node_provider

        provider = cache(lambda: node_provider(str(BOOTSTRAP_CONFIG)))  # `ray up`'s copy on the head; made once
        server = enroll.serve(folder, enroll.read_token(args.token_file), port=args.port or enroll.PORT,
                              members=lambda: node_ips(provider()))
        log.info("issuing node certificates on port %d", server.server_address[1])
        server.serve_forever()
    else:
        if not args.head:
            raise ConfigError("tls enroll needs the head's IP ($RAY_HEAD_IP in cluster.yaml's worker commands)")
        enroll.enroll(folder, args.head, enroll.read_token(args.token_file), port=args.port or enroll.PORT)
        log.info("this node's certificate from the head %s is in %s", args.head, folder)
    return 0


@command("serve", "the status service and live page (FastAPI)",
         arg("--host", default="127.0.0.1"), arg("--port", type=int, default=8000),
         arg("--forwarded-allow-ips", default="", metavar="IPS",
             help="the reverse proxies whose X-Forwarded-For is believed (comma-separated; default: none, so "
                  "each client is the address that connects, and a forged header cannot dodge the limit)"),
         arg("--read-only", action="store_true",
             help="serve without CN_API_TOKEN: e-mail addresses and PANs always masked, no reruns"))
def cmd_serve(args) -> int:
    import uvicorn

    from pipeline import credentials
    from pipeline.api import create_app

    settings = credentials.resolve(_on_redis(Settings.from_env()))  # the secret's token_key checks the notes' links
    settings.hmac_key()  # the clients' links are checked with it: a secret without one is said at start
    if not settings.api_token and not args.read_only:
        raise ConfigError("CN_API_TOKEN is not set: without it the service cannot tell operators from anyone "
                          "else; set it, or pass --read-only (no PII, no reruns)")
    uvicorn.run(create_app(settings, read_only=args.read_only), host=args.host, port=args.port, log_level="info",
                proxy_headers=bool(args.forwarded_allow_ips), forwarded_allow_ips=args.forwarded_allow_ips or None)
    return 0


@command("demo", "the embedded default: synthesize a day and run it with local services",
         arg("--accounts", type=_positive, default=500), arg("--workdir", type=Path, default=Path("demo")),
         arg("--date", type=_date, default=dt.date(2026, 11, 20)), arg("--seed", type=int, default=1),
         arg("--segment-share", type=_share, default=0.1,
             help="the share of clients who also trade currency, commodities and BSE index options (0 to 1)"),
         arg("--bounce-rate", type=float, default=0.0,
             help="the test relay returns DSNs for this share of the mail (half permanent, half delayed) to the "
                  "VERP addresses, and the demo reads them back with `bounces`"),
         arg("--file-key", action="store_true",
             help="sign with a test key file instead of the key on a SoftHSM2 token the demo makes"),
         arg("--bounce-window-h", type=_window_h, metavar="H",
             help="the demo's run records a bounce window of H hours, 0 included: `close` seals it at once "
                  "(a real run's is CN_BOUNCE_WINDOW_H, 1 to 720 h)"),
         arg("--services", action="store_true",
             help="no run: start the demo's Redis and SMTP sink again, in the background, on the ports its run "
                  "recorded (for the commands after the demo: README, 'After the demo')"))
def cmd_demo(args) -> int:
    from pipeline import embedded

    work = args.workdir.resolve()
    if args.services:
        return embedded.serve_again(work)
    import ray

    from pipeline.cluster.driver import RunRequest, run_day
    from pipeline.day.synth import SynthOptions, write_dumps

    write_dumps(work / "input", SynthOptions(args.date, args.accounts, args.seed, segment_share=args.segment_share,
                                             holidays_file=os.environ.get("CN_HOLIDAYS_FILE", "")))
    services = []
    try:
        services.append(embedded.start_redis(work / "redis"))
        services.append(embedded.start_smtp_sink(work / "outbox", work / "smtp.log",
                                        embedded.sink_args(work, args.bounce_rate)))
        # unless one is set, a fresh owner password: the placeholder is public
        owner = None if os.environ.get("CN_OWNER_PASSWORD") else secrets.token_urlsafe(24)
        key = _demo_key(work, args.file_key)
        settings = Settings.from_env(store_url=str(work / "store"), redis_url=services[0].url,
                                     smtp_url=services[1].url, token_key_file=str(work / "keys" / "token.key"),
                                     owner_password=owner, **key).with_deadline()
        summary = run_day(settings, RunRequest(args.date.isoformat(), str(work / "input"),  # Ray starts in it
                                               bounce_window_h=args.bounce_window_h))
        summary["outbox"] = str(work / "outbox")
        named = {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}
        embedded.write_env(work, summary["run_id"], services[0].url, services[1].url, args.bounce_rate, owner,
                           {named[k]: str(v) for k, v in key.items()} | {named["token_key_file"]: settings.token_key_file})
        if args.bounce_rate:
            from pipeline.followup.bounces import collect
            from pipeline.record.state import RunState

            summary["bounces"] = collect(settings, summary["run_id"], [str(work / "bounces")])
            # the headline after the bounces: a bounced note is not delivered, and is owed on paper
            summary.update(RunState(settings.redis_url, summary["run_id"]).final_counts())
        print(json.dumps(summary), file=args.stdout)
        settled = sum(summary[s] for s in ("delivered", "deferred", "bounced", "physical"))
        return 0 if settled == summary["accounts"] else 1  # as `run`: each account delivered or sent to paper
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for service in reversed(services):
            service.stop()


def _demo_key(work: Path, file_key: bool) -> dict:
    """The demo signs as production does, with a key on a token: a SoftHSM2 token made once in
    the workdir, its key and certificate labelled LOCAL TEST (SOFTHSM2_CONF set before Ray starts,
    so the signer actors find it); with --file-key, a test key file as before."""
    if file_key:
        files = {"signer_key": "signer.key.pem", "signer_cert": "signer.cert.pem", "signer_chain": "root.cert.pem"}
        settings = {k: str(work / "keys" / name) for k, name in files.items()}
        _with_test_key_if_default(Settings(**settings), work / "keys", force=True)
        return settings
    from pipeline.seal.token import SOFTHSM, make_test_token

    made = (work / "hsm" / "cn-demo.cert.pem").exists()
    token = make_test_token(work / "hsm", label="cn-demo")
    if not made:
        log.warning("signing with a LOCAL TEST key made on a SoftHSM2 token in %s (not valid for real contract notes; "
                    "a broker's key is on its HSM: docs/aws.md)", token.conf.parent)
    return {"pkcs11_module": SOFTHSM, "pkcs11_token": token.label, "pkcs11_key": token.key_label,
            "pkcs11_pin_file": str(token.pin_file), "signer_cert": str(token.cert), "signer_chain": str(token.chain)}


if __name__ == "__main__":
    # stdout carries the command's result alone, for the tools that read its last line; what Ray
    # prints on its own (a retried task's error, from a thread, until the process exits) goes to
    # stderr with the logs
    result, sys.stdout = sys.stdout, sys.stderr
    sys.exit(main(stdout=result))
