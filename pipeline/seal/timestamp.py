"""An RFC 3161 timestamp over a run's proof, from a time-stamping authority (TSA) the broker
does not run: the seal then carries a time no one at the broker controls, and a proof made
again later cannot be back-dated (CN_TSA_URL; followup/close.py). `openssl ts -verify` checks
the token as `check` does here.
"""

from __future__ import annotations

import asyncio
import hashlib

from asn1crypto import cms

from pipeline.seal import detached
from pipeline.seal.signer import SignError


def request(url: str, data: bytes) -> bytes:
    """The DER TimeStampToken for `data`'s SHA-256, with a nonce (pyHanko's client)."""
    from pyhanko.sign.timestamps import HTTPTimeStamper

    try:
        token = asyncio.run(HTTPTimeStamper(url, timeout=30).async_timestamp(hashlib.sha256(data).digest(), "sha256"))
    except Exception as e:  # aiohttp, the TSA's refusal, a bad reply: the seal is not written without it
        raise SignError(f"CN_TSA_URL {url}: no timestamp ({type(e).__name__}: {str(e)[:200]})") from None
    return token.dump()


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
