"""One check of an index address: the connector's and the sidecar's settings
refuse exactly what the index client (``maru_core.protocol.url.parse_url``)
would refuse, at start-up and with its reason, instead of at the first call."""

from __future__ import annotations

import argparse

import pytest
from maru_connector.config import MaruConfigError, parse_config
from maru_core.protocol.url import parse_url
from maru_sidecar.config import ConfigError, SidecarConfig, add_arguments

BAD = [
    ("http://x", "scheme 'http' is not supported"),
    ("tcp://index", "needs both a host and a port"),  # no port
    ("tcp://index:99999", "port must be an integer 0-65535"),
    ("tcp://index:7700/cache", "nothing after the port"),
    ("unix://relative.sock", "absolute path"),
]
GOOD = ["tcp://index.ns.svc:7700", "tcp://[::1]:7700", "unix:///run/maru/index.sock"]


@pytest.mark.parametrize("url, reason", BAD, ids=[u for u, _ in BAD])
def test_a_bad_address_is_refused_by_the_connector_settings_with_the_clients_reason(url, reason):
    with pytest.raises(ValueError, match=reason):
        parse_url(url)
    with pytest.raises(MaruConfigError, match=reason) as info:
        parse_config({"maru_index_url": url, "maru_pool_path": "/dev/shm/p"})
    assert "maru_index_url" in str(info.value) and "tcp://HOST:PORT" in str(info.value)


@pytest.mark.parametrize("url, reason", BAD, ids=[u for u, _ in BAD])
def test_a_bad_address_is_refused_by_the_sidecar_settings_with_the_clients_reason(url, reason, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--pool", "/dev/shm/none", "--socket", str(tmp_path / "s.sock"), "--index", url])
    with pytest.raises(ConfigError, match=reason) as info:
        SidecarConfig.from_args(args, environ={})
    assert "--index" in str(info.value)


@pytest.mark.parametrize("url", GOOD)
def test_a_good_address_passes_both(url, tmp_path):
    parse_url(url)
    assert parse_config({"maru_index_url": url, "maru_pool_path": "/dev/shm/p"}).maru_index_url == url
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--pool", "/dev/shm/none", "--socket", str(tmp_path / "s.sock"), "--index", url])
    assert SidecarConfig.from_args(args, environ={}).index_url == url
