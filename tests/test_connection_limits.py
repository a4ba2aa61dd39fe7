"""The connection limits' defaults and the start-up refusals of both CLIs (the behaviour under a flood is in
integration_tests/test_slow_clients.py)."""

from __future__ import annotations

import resource

import pytest

from prorl_adapter.service import cli as rollout_cli
from sandbox_runtime import cli as runtime_cli
from sandbox_runtime.connections import DEFAULT_MAX_CONNECTIONS, ConnectionLimits, raise_descriptor_limit


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:
        assert raise_descriptor_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_default_caps_leave_half_the_descriptors_to_the_server():
    limits = ConnectionLimits().resolve()
    room = raise_descriptor_limit() // 2
    assert limits.max_connections == min(DEFAULT_MAX_CONNECTIONS, room)
    assert limits.max_connections_per_peer == limits.max_connections // 4
    assert ConnectionLimits(max_connections=40, max_connections_per_peer=40).resolve().max_connections_per_peer == 40


@pytest.mark.parametrize(
    ("limits", "fragment"),
    [
        (ConnectionLimits(max_connections=10**9), "would leave too few descriptors"),
        (ConnectionLimits(max_connections=10, max_connections_per_peer=11), "is above --max-connections 10"),
        (ConnectionLimits(header_timeout_s=0), "--header-timeout-s 0 must be in (0, 86400]"),
        (ConnectionLimits(body_timeout_s=-1), "--body-timeout-s -1 must be"),
        (ConnectionLimits(max_connections=-1), "--max-connections -1 must be an integer >= 0"),
    ],
)
def test_limits_that_cannot_work_are_refused_naming_the_flag(limits, fragment):
    with pytest.raises(ValueError) as refused:
        limits.resolve()
    assert fragment in str(refused.value)


@pytest.mark.parametrize(
    ("main", "argv", "program"),
    [
        (runtime_cli.main, ["serve", "--max-connections", "999999999"], "prorl-sandbox"),
        (rollout_cli.main, ["serve", "--tokenizer", "x", "--max-connections", "999999999"], "prorl-rollout"),
    ],
)
def test_a_server_with_caps_beyond_its_descriptors_says_why_in_one_line(main, argv, program, capsys):
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"{program}: --max-connections 999999999 would leave too few descriptors")
    assert out.count("\n") == 1
