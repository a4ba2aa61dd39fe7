import subprocess

import pytest

from sandbox_runtime.session import encode_command, key_bytes


@pytest.mark.parametrize(
    "command",
    [
        "echo 'single' \"double\" \\backslash $HOME `date`",
        "printf 'a\\tb\\n'\necho second line\n",
        "cat <<'EOF'\nheredoc with ' and \\\nEOF",
        "echo \x03\x04\x1a\x7f control bytes",
        "echo ünïcödé ✓",
    ],
)
def test_encoded_command_is_one_line_that_bash_evaluates_verbatim(command):
    line = encode_command(f"__out={command!r}")  # any text: here a Python repr, so it stays a safe assignment
    assert b"\n" not in line and not any(b < 0x20 or b == 0x7F for b in line)
    # bash's own parser is the oracle: eval of the line must see exactly the original text.
    script = line.replace(b"eval ", b"printf %s ", 1)
    printed = subprocess.run(["bash", "-c", script.decode()], capture_output=True, check=True).stdout
    assert printed.decode() == f"__out={command!r}"


def test_raw_command_survives_the_round_trip():
    command = "echo 'it''s' \\\\ \x01 end\nsecond"
    script = encode_command(command).replace(b"eval ", b"printf %s ", 1)
    printed = subprocess.run(["bash", "-c", script.decode()], capture_output=True, check=True).stdout
    assert printed.decode() == command


def test_keys():
    assert key_bytes("C-c") == b"\x03"
    assert key_bytes("C-D") == b"\x04"
    assert key_bytes("Enter") == b"\r"
    assert key_bytes("Up") == b"\x1b[A"
    for bad in ("C-", "C-1", "F13", "ctrl-c"):
        with pytest.raises(ValueError, match="unknown key"):
            key_bytes(bad)
