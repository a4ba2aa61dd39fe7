import pytest

from sandbox_runtime.config import ServerConfig
from server_kit.address import is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    ServerConfig(host=host).check()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "example.org"])
def test_other_hosts_need_a_token(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="without a token"):
        ServerConfig(host=host).check()
    ServerConfig(host=host, token="t").check()


def test_the_rollout_service_refuses_a_public_bind_without_a_token(capsys, monkeypatch):
    from prorl_adapter.service.cli import main

    monkeypatch.delenv("PRORL_ROLLOUT_TOKEN", raising=False)
    argv = ["serve", "--host", "0.0.0.0", "--sandbox-url", "http://s", "--llm-url", "http://l", "--tokenizer", "t"]
    assert main(argv) == 2
    assert "PRORL_ROLLOUT_TOKEN" in capsys.readouterr().err
