import base64
import email
from email import policy

import pytest

from pipeline.mail.message import Letter, PermanentMailError, _b64, _b64_python, _encoder, build_message, message_id
from pipeline.mail.relay import RetryPolicy

LETTER = Letter("Notes <n@broker.example.com>", "Desk <desk@broker.example.com>")


def parse(raw: bytes):
    return email.message_from_bytes(raw, policy=policy.default)


def test_message_has_crlf_only_and_parses_back_with_the_pdf():
    pdf = b"%PDF-1.7\n" + bytes(range(256)) * 50
    raw = build_message(LETTER, "Aarav Iyer", "c1@example.com", "2026-11-20", "C1",
                        message_id("run1", "C1"), pdf)
    assert b"\n" not in raw.replace(b"\r\n", b"")
    msg = parse(raw)
    assert msg["To"].addresses[0].addr_spec == "c1@example.com"
    assert msg["Message-ID"] == message_id("run1", "C1")
    [part] = list(msg.iter_attachments())
    assert part.get_filename() == "ContractNote_C1_20261120.pdf"
    assert part.get_content() == pdf


@pytest.mark.parametrize("size", [0, 1, 2, 56, 57, 58, 59, 57 * 32 - 1, 57 * 32, 57 * 32 + 1, 57 * 64, 35_999])
def test_attachments_of_every_length_are_cut_into_base64_lines_of_76(size):
    """In C (mime_b64.c) and in Python (cut 32 lines at a time): a PDF that ends inside, at or
    just after a line or a block keeps every byte, with lines as the standard library cuts them."""
    pdf = bytes((i * 131 + 7) % 256 for i in range(size))
    raw = build_message(LETTER, "A", "c1@example.com", "2026-11-20", "C1", message_id("run1", "C1"), pdf)
    body = raw.split(b'filename="ContractNote_C1_20261120.pdf"\r\n\r\n')[1].rsplit(b"\r\n--", 1)[0]
    expected = base64.encodebytes(pdf).replace(b"\n", b"\r\n").removesuffix(b"\r\n")
    assert body == expected == _b64_python(pdf)
    [part] = list(parse(raw).iter_attachments())
    assert part.get_content() == pdf


def test_the_compiled_base64_is_the_one_in_use_and_agrees_on_every_short_length():
    assert _encoder() is not None, "built on first use: gcc (scripts/install.sh)"
    for size in range(0, 300):
        data = bytes((i * 67 + size) % 256 for i in range(size))
        assert bytes(_b64(data)) == _b64_python(data), size


def test_the_attachment_written_in_place_in_the_message_is_its_base64_at_every_edge_of_a_line():
    """build_message has C write the attachment's lines into the message's own buffer, after
    the headers: the same bytes as the lines made alone, whole lines (57 bytes) or not."""
    for size in (1, 2, 3, 56, 57, 58, 113, 114, 115, 171, 1000, 35_901):
        pdf = bytes((i * 31 + size) % 256 for i in range(size))
        raw = build_message(LETTER, "A", "c1@example.com", "2026-11-20", "C1", "<id@x>", pdf)
        body = raw.split(b'filename="ContractNote_C1_20261120.pdf"\r\n\r\n')[1]
        assert body == _b64_python(pdf) + b"\r\n--=_cn-mixed-7f3a9c--\r\n", size


def test_message_ids_are_derived_from_run_and_account():
    assert message_id("r", "C1") == message_id("r", "C1")
    assert len({message_id("r", "C1"), message_id("r", "C2"), message_id("s", "C1")}) == 3


def test_client_data_cannot_inject_headers():
    raw = build_message(LETTER, "Eve\r\nBcc: victim@example.com", "c1@example.com", "2026-11-20",
                        "C1\r\nX-Evil: 1", "<id@x>", b"%PDF")
    msg = parse(raw)
    assert msg["Bcc"] is None and msg["X-Evil"] is None
    with pytest.raises(PermanentMailError):
        build_message(LETTER, "Eve", "c1@example.com\r\nBcc: v@example.com", "2026-11-20", "C1",
                      "<id@x>", b"%PDF")


def test_non_ascii_names_are_encoded_not_mangled():
    msg = parse(build_message(LETTER, "राहुल वर्मा", "r@example.com", "2026-11-20", "C9", "<i@x>", b"%PDF"))
    assert msg["To"].addresses[0].display_name == "राहुल वर्मा"


def test_backoff_grows_and_is_capped():
    p = RetryPolicy(attempts=6, base_s=0.1, cap_s=0.5)
    assert all(0 <= p.delay(a) <= min(0.5, 0.1 * 2 ** a) for a in range(6) for _ in range(20))


def test_the_message_carries_text_and_html_from_templates_and_reply_to():
    msg = parse(build_message(LETTER, "<b>Eve</b> & Co", "e@example.com", "2026-11-20", "C7", "<i@x>", b"%PDF"))
    assert msg["Reply-To"] == "Desk <desk@broker.example.com>"
    assert msg["Subject"] == "Contract note for 2026-11-20 (C7)"
    text = msg.get_body(("plain",)).get_content()
    page = msg.get_body(("html",)).get_content()
    assert "Dear <b>Eve</b> & Co," in text and "PAN in capital letters" in text
    assert "Dear &lt;b&gt;Eve&lt;/b&gt; &amp; Co," in page and "<b>Eve</b>" not in page
    assert [p.get_filename() for p in msg.iter_attachments()] == ["ContractNote_C7_20261120.pdf"]


def test_the_mail_asks_for_replies_where_its_reply_to_sends_them(settings, tmp_path):
    """Before, the body said "please do not reply ... write to compliance@..." under a Reply-To of
    Client Support: the text and the header disagreed."""
    import asyncio
    import dataclasses

    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.stages import mail_context

    desk = dataclasses.replace(settings, mail_reply_to="Client Desk <desk@broker.example.com>")
    state = RunState(settings.redis_url, f"reply-to-{tmp_path.name}"[:60])
    state.start({})
    async def letter_of():  # a mail context belongs to the event loop that sends
        ctx = mail_context(desk, state, open_store(str(tmp_path)))
        await ctx.pool.close()
        return ctx.letter

    letter = asyncio.run(letter_of())
    msg = parse(build_message(letter, "Eve", "e@example.com", "2026-11-20", "C7", "<i@x>", b"%PDF"))
    text, page = msg.get_body(("plain",)).get_content(), msg.get_body(("html",)).get_content()
    assert msg["Reply-To"] == "Client Desk <desk@broker.example.com>"
    for body in (text, page):
        assert "reply to this message" in body and "desk@broker.example.com" in body and "do not reply" not in body
