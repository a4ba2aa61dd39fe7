from sandbox_runtime.output import OutputBuffer, clean_text


def test_small_output_is_kept_whole():
    buffer = OutputBuffer(100)
    buffer.feed(b"hello ")
    buffer.feed(b"world\n")
    assert buffer.take() == ("hello world\n", False)
    assert buffer.take() == ("", False)  # take empties the buffer


def test_large_output_keeps_head_and_tail_with_a_notice():
    buffer = OutputBuffer(100)
    for i in range(10_000):
        buffer.feed(f"{i:05d}\n".encode())
    text, truncated = buffer.take()
    assert truncated
    assert text.startswith("00000\n00001\n")
    assert text.endswith("09998\n09999\n")
    assert "[... 59900 bytes of output omitted ...]" in text
    assert len(text) < 200


def test_memory_stays_bounded_for_endless_output():
    buffer = OutputBuffer(1000)
    chunk = b"y" * 65536
    for _ in range(200):
        buffer.feed(chunk)
    assert len(buffer._head) + len(buffer._tail) <= 1000 + 65536
    assert buffer.total == 200 * 65536


def test_escape_sequences_are_stripped():
    raw = b"\x1b[31mred\x1b[0m \x1b]0;window title\x07plain \x1b[?2004hpaste\x1b[?2004l \x1b=keypad \x1b(Bascii"
    assert clean_text(raw) == "red plain paste keypad ascii"


def test_invalid_utf8_is_replaced_not_raised():
    assert clean_text(b"ok \xff\xfe end \xe2\x82") == "ok \ufffd\ufffd end \ufffd"
    assert clean_text("naïve ✓".encode()) == "naïve ✓"
