"""PII masked where a reader need not see it: the status service without its token, and the
run's log kept in storage (pipeline/record/run_log.py). A PAN shows its last four characters,
an address its first letter and domain, a name its initials."""

from __future__ import annotations

import re

EMAIL_IN_TEXT = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
PAN_IN_TEXT = re.compile(r"\b[A-Z]{5}[0-9]{4}[A-Z]\b")


def mask_text(text: str) -> str:
    """Addresses and PANs inside free text (a relay's "550 5.1.1 <client@...>"), masked."""
    text = EMAIL_IN_TEXT.sub(lambda m: mask_email(m.group(0)), text)
    return PAN_IN_TEXT.sub(lambda m: mask_pan(m.group(0)), text)


def mask_email(email: str) -> str:
    local, _, domain = email.partition("@")
    return f"{local[:1]}***@{domain}" if domain else "***"


def mask_name(name: str) -> str:
    """Initials only: enough to tell two accounts apart on a call, not to name the client."""
    return " ".join(f"{word[0]}***" for word in name.split()) or "***"


def mask_pan(pan: str) -> str:
    return "******" + pan[-4:] if len(pan) == 10 else "***"
