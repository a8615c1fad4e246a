"""An RFC 3161 timestamp over a run's proof, from a time-stamping authority (TSA) the broker
does not run: the seal then carries a time no one at the broker controls, and a proof made
again later cannot be back-dated (CN_TSA_URL; followup/close.py). `openssl ts -verify` checks
the token as `check` does here.
"""

from __future__ import annotations

import asyncio
import hashlib

from asn1crypto import cms, core, tsp

from pipeline.seal import detached
from pipeline.seal.signer import SignError


class _Reply(core.Sequence):
    """A TimeStampResp as RFC 3161 has it: its token OPTIONAL, absent from a refusal (asn1crypto's
    TimeStampResp requires it, so a TSA's "no" would read as a parse error)."""

    _fields = [("status", tsp.PKIStatusInfo), ("time_stamp_token", cms.ContentInfo, {"optional": True})]


def request(url: str, data: bytes) -> bytes:
    """The DER TimeStampToken for `data`'s SHA-256, with a nonce (pyHanko's client); SignError
    saying what the TSA did instead ("refused: " and its own words, "answered with no RFC 3161
    reply", "gave no timestamp"), for the caller to put after the TSA's name."""
    from pyhanko.sign.timestamps import HTTPTimeStamper
    from pyhanko.sign.timestamps.common_utils import handle_tsp_response

    stamper = HTTPTimeStamper(url, timeout=30)
    nonce, query = stamper.request_cms(hashlib.sha256(data).digest(), "sha256")
    try:
        reply = asyncio.run(stamper.async_request_tsa_response(query))
    except Exception as e:  # aiohttp, an HTTP error, a URL it cannot encode: the seal is not written without it
        if _raised_in("/asn1crypto/", e):  # the TSA's body, read as a TimeStampResp, is none
            raise SignError(f"answered with no RFC 3161 reply ({_line(e)})") from None
        raise SignError(f"gave no timestamp ({_why(e)})") from None
    _granted(reply)
    try:
        return handle_tsp_response(reply, nonce).dump()
    except Exception as e:  # a nonce not ours, a token that is none
        raise SignError(f"gave no timestamp ({_why(e)})") from None


def _granted(reply: tsp.TimeStampResp) -> None:
    """SignError "refused: ..." unless the reply's status grants the request."""
    try:
        status = _Reply.load(reply.dump())["status"]
        granted = status["status"].native in ("granted", "granted_with_mods")
        if not granted:  # read here too: words not UTF-8 or a failure bit asn1crypto has no name for
            words = "; ".join(status["status_string"].native or []) or str(status["status"].native)
            failed = ", ".join(sorted(str(bit) for bit in status["fail_info"].native or []))
    except (ValueError, TypeError, KeyError) as e:  # UnicodeDecodeError among them
        raise SignError(f"answered with no RFC 3161 reply ({_line(e)})") from None
    if not granted:
        raise SignError(_flat(f"refused: {words}", 300) + (f" ({failed})" if failed else ""))


def _why(e: BaseException) -> str:
    """The error and what caused it (pyHanko says "Error while contacting timestamp service" for
    a connection refused and an HTTP error alike; its cause tells which), in one line."""
    cause = e.__cause__
    return f"{_line(e)} ({_line(cause)})" if cause else _line(e)


def _raised_in(folder: str, e: BaseException) -> bool:
    """Whether the innermost frame of `e`'s traceback runs code under `folder`."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and folder in tb.tb_frame.f_code.co_filename


def _line(e: BaseException) -> str:
    """An error in one line: asn1crypto's own end "\n    while parsing ...", and the caller's
    message (close's one line) must stay one."""
    return _flat(f"{type(e).__name__}: {e}", 200)


def _flat(text: str, limit: int) -> str:
    """`text` on one line (each run of whitespace a space), cut at `limit` characters."""
    return " ".join(text.split())[:limit]


def check(token: bytes, data: bytes, tsa_cert_pem: bytes | None = None) -> dict:
    """{"time", "tsa"} if `token` is a TSA's valid signature over `data`'s SHA-256 (by the TSA
    whose certificate is given, when one is); SignError otherwise."""
    try:
        signed = cms.ContentInfo.load(token)["content"]
        content = signed["encap_content_info"]["content"]
        info = content.parsed
        imprint = info["message_imprint"]
        algorithm, hashed, at = (imprint["hash_algorithm"]["algorithm"].native, imprint["hashed_message"].native,
                                 info["gen_time"].native)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SignError(f"not an RFC 3161 timestamp token ({type(e).__name__})") from None
    if algorithm != "sha256" or hashed != hashlib.sha256(data).digest():
        raise SignError("the timestamp is not over this proof (the proof was changed after it was timestamped)")
    tsa = detached.signed_by(signed, hashlib.sha256(content.contents).digest())
    if tsa_cert_pem and not tsa.endswith(detached.fingerprint(tsa_cert_pem)):
        raise SignError(f"timestamped by {tsa}, not by the TSA certificate given")
    return {"time": at.isoformat(), "tsa": tsa}
