import pytest

from sandbox_runtime.config import ServerConfig, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    ServerConfig(host=host).check_exposure()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "example.org"])
def test_other_hosts_need_a_token(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="without a token"):
        ServerConfig(host=host).check_exposure()
    ServerConfig(host=host, token="t").check_exposure()
