"""The pieces of a sandbox's own file system (workspace_fs.py) that need no mount: the image's mode, the loop
device's node, and the room a creation is admitted with."""

import errno
import os
import stat

import pytest

from sandbox_runtime import workspace_fs


def test_a_sandboxs_disk_image_is_readable_by_the_server_alone(tmp_path):
    source = tmp_path / "template.img"
    with open(source, "wb") as handle:
        handle.truncate(8 << 20)
        handle.seek(1 << 20)
        handle.write(b"superblock")
    old = os.umask(0)  # the server's umask does not widen it
    try:
        workspace_fs.copy_sparse(source, tmp_path / "disk.img")
    finally:
        os.umask(old)
    copied = tmp_path / "disk.img"
    assert stat.S_IMODE(copied.stat().st_mode) == 0o600
    assert copied.read_bytes() == source.read_bytes()
    assert copied.stat().st_blocks * 512 < 1 << 20  # holes stay holes
    with pytest.raises(FileExistsError):  # never over an existing file (a link planted there, say)
        workspace_fs.copy_sparse(source, copied)


def test_a_missing_loop_node_is_made_as_the_block_device_the_kernel_numbered(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(os, "mknod", lambda path, mode, device: made.append((str(path), mode, device)))
    assert workspace_fs.loop_node(12, tmp_path) == str(tmp_path / "loop12")
    assert made == [(str(tmp_path / "loop12"), stat.S_IFBLK | 0o660, os.makedev(7, 12))]
    (tmp_path / "loop3").touch()  # present: used as it is
    assert workspace_fs.loop_node(3, tmp_path) == str(tmp_path / "loop3")
    assert len(made) == 1


def test_a_loop_node_that_cannot_be_made_says_which_and_why(tmp_path, monkeypatch):
    def refuse(path, mode, device):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "mknod", refuse)
    with pytest.raises(OSError, match=f"loop device 9 has no node {tmp_path}/loop9") as error:
        workspace_fs.loop_node(9, tmp_path)
    assert error.value.errno == errno.EPERM


def test_a_node_made_by_another_process_meanwhile_is_used(tmp_path, monkeypatch):
    def raced(path, mode, device):
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(os, "mknod", raced)
    assert workspace_fs.loop_node(4, tmp_path) == str(tmp_path / "loop4")


def test_a_live_image_may_still_take_its_size_less_what_it_holds(tmp_path):
    image = tmp_path / "disk.img"
    assert workspace_fs.unwritten(image, 64 << 20) == 64 << 20  # not made yet: all of it
    with open(image, "wb") as handle:
        handle.truncate(64 << 20)
        handle.write(b"x" * (1 << 20))
        handle.flush()
        os.fsync(handle.fileno())
    left = workspace_fs.unwritten(image, 64 << 20)
    assert 62 << 20 <= left <= 63 << 20
    assert workspace_fs.unwritten(image, 1 << 10) == 0  # never below nothing


def test_a_creation_is_admitted_only_with_room_for_every_live_sandbox_and_the_floor(tmp_path):
    info = os.statvfs(tmp_path)
    free = info.f_bavail * info.f_frsize
    workspace_fs.admit(tmp_path, 1 << 20, 0)
    with pytest.raises(workspace_fs.DiskError, match="no space on the server's state disk") as refused:
        workspace_fs.admit(tmp_path, 1 << 20, free)  # the live sandboxes may take all that is free
    assert refused.value.status == 507 and "stay free for the image cache" in str(refused.value)
    with pytest.raises(workspace_fs.DiskError):
        workspace_fs.admit(tmp_path, free, 0)  # the floor stays free too
