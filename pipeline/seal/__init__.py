"""Signing and encrypting a rendered note: PAdES signature, AES-256 (R6) with the client's PAN.
Bytes in, bytes out: no Redis, no storage, no Ray."""
