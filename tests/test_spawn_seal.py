"""What the server's starter left open without close-on-exec is sealed at start-up (cli.main), before the app is
built, not only at the first spawn (integration_tests/test_host_view.py shows none reaching a sandbox)."""

import os

from sandbox_runtime import cli, server, spawn
from server_kit import webapp


def test_the_server_seals_inherited_descriptors_before_it_builds_its_app(tmp_path, monkeypatch):
    monkeypatch.setattr(spawn, "_sealed", False)
    read, write = os.pipe()
    os.set_inheritable(read, True)  # as a shell's `exec 7<file` leaves it
    seen = []

    async def serve(config, ready=None):  # stands in for the app's construction and serving
        seen.append(os.get_inheritable(read))

    def run_forever(main):
        main.close()
        seen.append(os.get_inheritable(read))

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.setattr(webapp, "run_forever", run_forever)
    try:
        cli.main(["serve", "--state-dir", str(tmp_path / "state"), "--backend", "local"])
        assert seen == [False]  # sealed by the time the app's coroutine is handed to the loop
        assert spawn._sealed  # and the first spawn's guard knows it
    finally:
        os.close(read)
        os.close(write)
