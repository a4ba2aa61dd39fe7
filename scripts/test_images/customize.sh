#!/bin/sh
# mmdebstrap's customize hook for the test image (scripts/build_test_images.py passes it): $1 is the new root,
# /testbed already copied in from scripts/test_images/testbed/. Runs as (namespaced) root in every mmdebstrap
# mode, so chroot works.
set -eu
root="$1"
# mmdebstrap copies the host's; an image built elsewhere must not differ by them (see SOURCE_DATE_EPOCH in
# mmdebstrap(1)).
rm -f "$root/etc/resolv.conf" "$root/etc/hostname"
# The sandboxes run as an unprivileged uid, and git refuses a repository another user owns unless told.
printf '[safe]\n\tdirectory = *\n' >"$root/etc/gitconfig"
chmod 0644 "$root/etc/gitconfig"
# One commit with a fixed author, committer and date: the same files give the same hash on every build.
chroot "$root" /bin/sh -eu -c '
umask 022
cd /testbed
chmod -R u=rwX,go=rX .
export GIT_AUTHOR_NAME="prorl-adapter tests" GIT_AUTHOR_EMAIL="tests@prorl-adapter.invalid"
export GIT_COMMITTER_NAME="prorl-adapter tests" GIT_COMMITTER_EMAIL="tests@prorl-adapter.invalid"
export GIT_AUTHOR_DATE="2024-01-01T00:00:00+0000" GIT_COMMITTER_DATE="2024-01-01T00:00:00+0000"
git init -q --template= --initial-branch=main .
git add -A
git commit -q -m "calc: arithmetic helpers"
# The index without the stat data of this build (inode, ctime): the same bytes on every build. git status
# re-reads the files once and finds them clean.
git read-tree HEAD
'
