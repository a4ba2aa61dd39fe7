"""The sandboxes' /etc (host_view.build_etc) from a host /etc made here, and the start-up rule for --host-path."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sandbox_runtime.host_view import build_etc, check_host_path, passwd, write_identity


@pytest.fixture
def host_etc(tmp_path):
    etc = tmp_path / "host-etc"
    (etc / "ssl" / "certs").mkdir(parents=True)
    (etc / "ssl" / "certs" / "ca-certificates.crt").write_text("CERTS")
    (etc / "ssl" / "certs" / "abcd.0").symlink_to("/usr/share/ca-certificates/x.crt")
    (etc / "ssl" / "certs" / "key.pem").write_text("KEY")
    (etc / "ssl" / "certs" / "key.pem").chmod(0o600)  # not world-readable: never copied
    (etc / "ssl" / "private").mkdir()
    (etc / "ld.so.cache").write_text("cache")
    (etc / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
    (etc / "python3.11").mkdir()
    (etc / "python3.11" / "sitecustomize.py").write_text("")
    for secret in ("shadow", "machine-id", "gitconfig", "pip.conf", "ld.so.preload", "hostname", "passwd"):
        (etc / secret).write_text(f"host {secret}")
        (etc / secret).chmod(0o644)
    return etc


def test_only_listed_world_readable_entries_of_the_host_etc_are_copied_links_as_links(tmp_path, host_etc):
    made = tmp_path / "state" / "host-etc"
    made.parent.mkdir()
    (made / "stale").mkdir(parents=True)  # a previous server's
    old = os.umask(0o077)  # whatever the server's umask: readable by every sandbox uid
    try:
        build_etc(made, host_etc)
    finally:
        os.umask(old)
    names = {str(p.relative_to(made)) for p in made.rglob("*")}
    assert names == {
        "ssl",
        "ssl/certs",
        "ssl/certs/ca-certificates.crt",
        "ssl/certs/abcd.0",
        "ld.so.cache",
        "localtime",
        "python3.11",
        "python3.11/sitecustomize.py",
        *("passwd", "group", "hostname", "hosts", "nsswitch.conf", "resolv.conf"),
    }
    assert os.readlink(made / "localtime") == "/usr/share/zoneinfo/Etc/UTC"
    assert os.readlink(made / "ssl/certs/abcd.0") == "/usr/share/ca-certificates/x.crt"
    assert (made / "hostname").read_text() == "sandbox\n" and (made / "resolv.conf").read_text() == ""
    assert "host" not in (made / "passwd").read_text()
    for path in [made, *made.rglob("*")]:
        if not path.is_symlink():
            assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def test_a_sandbox_finds_its_own_uid_but_no_other(tmp_path):
    files = write_identity(tmp_path, 2_000_000_007, 2_000_000_007, "/workspace")
    assert files[0].read_text().splitlines()[-1] == "sandbox:x:2000000007:2000000007:sandbox:/workspace:/bin/bash"
    assert files[1].read_text().splitlines()[-1] == "sandbox:x:2000000007:"
    assert passwd(65534, 65534, "/workspace").count("65534") == 2  # an unprivileged server run as nobody: one entry


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("opt/agent", "not an absolute path"),
        ("/opt/../etc", "not an absolute path"),
        ("/no/such/path", "does not exist"),
        ("/usr/lib", "see already or have their own of"),
        ("/tmp", "see already or have their own of"),
        ("/bin", "see already or have their own of"),
        ("/", "see already or have their own of"),
        ("{state}", "state dir"),
        ("{state}/info", "state dir"),
        ("{above}", "state dir"),
    ],
)
def test_a_host_path_that_cannot_be_shown_is_refused(path, message):
    state = Path("/var/lib/dpkg")  # a state dir outside the refused tops, with a directory in it (Debian's)
    if not (state / "info").is_dir():
        pytest.skip(f"{state}/info does not exist here")
    path = Path(path.format(state=state, above=state.parent))
    with pytest.raises(ValueError, match=message):
        check_host_path(path, state)


def test_a_path_beside_the_state_dir_is_accepted():
    check_host_path(Path("/var/lib"), Path("/srv/prorl-state"))


def test_a_host_path_is_judged_where_it_resolves_and_bound_from_there(tmp_path):
    place = Path(tempfile.mkdtemp(prefix="prorl-test-links-", dir="/var/tmp"))  # not under /tmp: its own rules
    try:
        (place / "agent-v3").mkdir()
        for name, target in (("etc", "/etc"), ("usr-bin", "/usr/bin"), ("agent", place / "agent-v3")):
            (place / name).symlink_to(target)
        for name in ("etc", "usr-bin"):  # /var/tmp/x -> /etc would show the host's /etc
            with pytest.raises(ValueError, match=r"a link to .*see already or have their own of"):
                check_host_path(place / name, tmp_path / "state")
        (place / "state-dir").mkdir()
        (place / "state").symlink_to(place / "state-dir")
        with pytest.raises(ValueError, match="state dir"):  # a link to the state dir
            check_host_path(place / "state", place / "state-dir")
        (place / "nothing").symlink_to(place / "gone")
        with pytest.raises(ValueError, match="does not exist"):
            check_host_path(place / "nothing", tmp_path)
        assert check_host_path(place / "agent", tmp_path / "state") == place / "agent-v3"
    finally:
        shutil.rmtree(place)
