"""The behavioural suite of sessions: runs against every backend available on this machine."""

from __future__ import annotations

import io
import tarfile

import pytest

from sandbox_runtime.client import SandboxAPIError

from .conftest import BACKENDS, SESSION_VARIANTS

# Every backend, and images: the Debian test image as a SIF file and as an OCI layout, and the apptainer stand-in.
pytestmark = pytest.mark.parametrize("runtime", [*BACKENDS, *SESSION_VARIANTS], indirect=True, scope="module")


@pytest.fixture
async def client(runtime):
    async with runtime.client() as client:
        yield client


@pytest.fixture
async def box(runtime, client):
    info = await client.create_sandbox(image=runtime.image())
    yield info
    await client.delete_sandbox(info.id)


async def run(client, box, command, **kwargs):
    return await client.exec(box.id, command, **kwargs)


async def test_state_persists_between_commands(client, box):
    first = await run(
        client, box, 'mkdir -p sub && cd sub && export GREETING=hello && greet() { echo "$1 $GREETING"; }'
    )
    assert first.status == "completed" and first.exit_code == 0
    assert first.cwd.endswith("/sub")
    second = await run(client, box, "greet world; pwd")
    assert second.output.splitlines() == ["world hello", first.cwd]


async def test_exit_codes_and_multiline_scripts(client, box):
    assert (await run(client, box, "false")).exit_code == 1
    assert (await run(client, box, "exit_with() { return $1; }; exit_with 7")).exit_code == 7
    script = "for i in 1 2 3; do\n  echo line $i\ndone\ncat <<'EOF'\nheredoc $HOME 'quoted' \\backslash\nEOF\n"
    result = await run(client, box, script)
    assert result.output == "line 1\nline 2\nline 3\nheredoc $HOME 'quoted' \\backslash\n"
    # An unfinished construct is a syntax error, not a shell left waiting for more input.
    broken = await run(client, box, "if true; then echo x")
    assert broken.status == "completed" and broken.exit_code != 0 and "syntax error" in broken.output
    assert (await run(client, box, "echo still here")).output == "still here\n"


async def test_long_command_line(client, box):
    payload = "x" * 100_000  # far beyond the 4 KB a terminal line holds in canonical mode
    result = await run(client, box, f"v={payload}; echo ${{#v}}")
    assert result.output == "100000\n"


async def test_set_euo_pipefail_script_ends_the_shell_like_a_terminal(client, box):
    await run(client, box, "cd /tmp")
    result = await run(client, box, "set -euo pipefail\necho before\nfalse | true\nfalse\necho never")
    assert result.status == "dead"
    assert result.exit_code == 1
    assert result.output == "before\n"
    again = await run(client, box, "echo fresh; pwd")
    assert again.status == "completed" and again.output.startswith("fresh\n")
    assert again.cwd != "/tmp"  # a new shell, back in the workdir


async def test_exit_restarts_the_session(client, box):
    result = await run(client, box, "echo bye; exit 3")
    assert (result.status, result.exit_code) == ("dead", 3)
    assert result.output.startswith("bye\n")  # bash then says "exit", as it does in a terminal
    assert (await run(client, box, "echo back")).output == "back\n"


async def test_timeout_interrupts_and_no_late_marker_leaks(client, box):
    result = await run(client, box, "echo started; sleep 30", timeout=2.0)
    assert result.status == "timeout" and "started" in result.output
    following = await run(client, box, "echo next")
    assert (following.status, following.output) == ("completed", "next\n")


async def test_timeout_kills_a_command_that_ignores_interrupts(client, box):
    result = await run(client, box, "trap '' INT; sleep 30; sleep 30; echo survived-kill", timeout=0.5)
    assert result.status == "timeout"
    assert (await run(client, box, "echo usable")).output == "usable\n"


async def test_timeout_of_a_busy_loop_in_the_shell_itself(client, box):
    result = await run(client, box, "while :; do :; done", timeout=0.5)
    assert result.status == "timeout"
    assert (await run(client, box, "echo usable")).output == "usable\n"


async def test_command_reading_stdin_times_out_cleanly(client, box):
    result = await run(client, box, "cat", timeout=0.5)
    assert result.status == "timeout"
    assert (await run(client, box, "echo after-cat")).output == "after-cat\n"


async def test_keep_mode_accepts_input_and_refuses_a_second_command(client, box):
    # The timeout is generous so that "question" is surely printed by then, even on a loaded machine.
    kept = await run(client, box, "echo question; read answer; echo got $answer", timeout=2.0, on_timeout="keep")
    assert kept.status == "timeout" and kept.output == "question\n"
    with pytest.raises(SandboxAPIError) as refused:
        await run(client, box, "echo no")
    assert refused.value.status == 409 and "on_timeout=keep" in refused.value.message
    progress = await client.read_output(box.id, "default")
    assert progress.status == "running" and progress.output == ""
    answered = await client.send_input(box.id, "default", text="yes\n", timeout=10)
    assert (answered.status, answered.exit_code, answered.output) == ("completed", 0, "got yes\n")
    assert (await run(client, box, "echo free")).output == "free\n"


async def test_keep_mode_interrupt_with_keys(client, box):
    kept = await run(client, box, "sleep 60", timeout=0.3, on_timeout="keep")
    assert kept.status == "timeout"
    stopped = await client.send_input(box.id, "default", keys="C-c", timeout=10)
    assert stopped.status == "interrupted" and stopped.exit_code == 130
    with pytest.raises(SandboxAPIError) as bad_key:
        await client.send_input(box.id, "default", keys="C-%")
    assert bad_key.value.status == 400


async def test_input_a_command_never_reads_ends_with_the_request_timeout(client, box):
    kept = await run(client, box, "sleep 60", timeout=0.3, on_timeout="keep")
    assert kept.status == "timeout"
    # 1 MB: far more than the terminal holds while nobody reads it. It used to hang past its timeout.
    flooded = await client.send_input(box.id, "default", text="x" * (1 << 20), timeout=1)
    assert flooded.status == "timeout" and "not all delivered" in flooded.output
    await client.delete_session(box.id, "default")
    assert (await run(client, box, "echo free")).output == "free\n"


async def test_named_sessions_are_independent(client, box):
    await run(client, box, "cd /tmp && export ONLY_HERE=1", session="one")
    other = await run(client, box, "pwd; echo ${ONLY_HERE:-unset}", session="two")
    assert other.output.splitlines()[1] == "unset" and other.cwd != "/tmp"
    await client.delete_session(box.id, "one")
    fresh = await run(client, box, "echo ${ONLY_HERE:-unset}", session="one")
    assert fresh.output == "unset\n"
    with pytest.raises(SandboxAPIError) as missing:
        await client.read_output(box.id, "never-made")
    assert missing.value.status == 404


async def test_output_without_newline_forever_is_capped(client, box):
    result = await run(client, box, "yes | tr -d '\\n'", timeout=1.0, max_output_bytes=10_000)
    assert result.status == "timeout" and result.truncated
    assert "bytes of output omitted" in result.output
    assert len(result.output) < 10_200
    assert (await run(client, box, "echo ok")).output == "ok\n"


async def test_fifty_megabytes_of_output(client, box):
    result = await run(client, box, "head -c 50000000 /dev/zero | tr '\\0' a; echo; echo END", timeout=60)
    assert result.status == "completed" and result.exit_code == 0 and result.truncated
    assert result.output.startswith("aaaa") and result.output.endswith("END\n")
    assert len(result.output) < 70_000


async def test_binary_and_escape_sequences_come_back_as_clean_text(client, box):
    result = await run(
        # No ESC in the random part: a lone ESC byte just before ours is data, and would stay (1 run in ~256).
        client,
        box,
        "head -c 20000 /dev/urandom | tr -d '\\033'; printf '\\033[31mred\\033[0m \\033]0;title\\007done\\n'",
    )
    assert result.status == "completed"
    assert result.output.endswith("red done\n")
    assert "\x1b" not in result.output[-20:]
    assert "\ufffd" in result.output  # invalid UTF-8 replaced, never an error


async def test_files_round_trip_and_confinement(client, box, runtime):
    await client.write_file(box.id, "dir/hello.txt", b"hello\x00bytes")
    assert await client.read_file(box.id, f"{box.workdir}/dir/hello.txt") == b"hello\x00bytes"
    assert (await run(client, box, "cat dir/hello.txt | wc -c")).output.strip() == "11"
    for bad in ("../../etc/passwd", "/etc/passwd"):
        with pytest.raises(SandboxAPIError) as refused:
            await client.read_file(box.id, bad)
        assert refused.value.status == 400
    await run(client, box, "ln -s /etc/passwd link && ln -s / rootlink")
    for through_link in ("link", "rootlink/etc/passwd"):
        with pytest.raises(SandboxAPIError) as refused:
            await client.read_file(box.id, through_link)
        assert refused.value.status == 400 and "symbolic link" in refused.value.message
    with pytest.raises(SandboxAPIError) as missing:
        await client.read_file(box.id, "nope.txt")
    assert missing.value.status == 404


async def test_archive_upload_and_download(client, box):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in {"pkg/a.py": b"print('a')\n", "pkg/sub/b.txt": b"b"}.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    assert await client.upload_archive(box.id, "src", buffer.getvalue()) >= 2
    assert (await run(client, box, "cat src/pkg/sub/b.txt")).output == "b"
    await run(client, box, "echo made-inside > src/pkg/new.txt")
    with tarfile.open(fileobj=io.BytesIO(await client.download_archive(box.id, "src")), mode="r:gz") as tar:
        names = set(tar.getnames())
        assert {"pkg/a.py", "pkg/sub/b.txt", "pkg/new.txt"} <= names
        assert tar.extractfile("pkg/new.txt").read() == b"made-inside\n"
