"""Strict parsing of kv_connector_extra_config and the generated kv-transfer-config."""

from __future__ import annotations

import logging

import pytest
from vllm.config import KVTransferConfig

from maru_connector.config import MaruConfigError, make_kv_transfer_config, parse_config

BASE = {"maru_index_url": "tcp://127.0.0.1:7000", "maru_pool_path": "/dev/shm/p"}


def test_defaults():
    cfg = parse_config(BASE, block_size=128)
    assert cfg.maru_kv_chunk_tokens == 256 and not cfg.maru_use_layerwise
    assert not cfg.maru_async_load and cfg.maru_async_store
    assert cfg.fmt_name == "chunkwise"


def test_unknown_key_names_the_key_and_the_closest_known_one():
    with pytest.raises(MaruConfigError, match=r"'maru_use_layerwize'.*did you mean 'maru_use_layerwise'"):
        parse_config({**BASE, "maru_use_layerwize": True})


@pytest.mark.parametrize(
    "key, value",
    [
        ("maru_async_load", "true"),
        ("maru_kv_chunk_tokens", 256.0),
        ("maru_kv_chunk_tokens", True),
        ("maru_lookup_timeout_s", "fast"),
        ("maru_index_url", 7000),
    ],
)
def test_ill_typed_value_names_the_key(key, value):
    with pytest.raises(MaruConfigError, match=key):
        parse_config({**BASE, key: value})


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"maru_pool_path": "/p"}, "maru_index_url"),
        ({"maru_index_url": "http://x"}, "tcp://HOST:PORT"),
        ({"maru_index_url": "tcp://h:1"}, "exactly one of maru_pool_path"),
        ({**BASE, "maru_sidecar_socket": "/s"}, "exactly one of maru_pool_path"),
        ({**BASE, "maru_token": "a", "maru_token_file": "/t"}, "not both"),
        ({**BASE, "maru_overlap_release_after_layers": -1}, "at least 0"),
        ({**BASE, "maru_load_timeout_s": 0}, "maru_load_timeout_s"),
    ],
)
def test_conflicts_and_missing_keys_say_what_to_change(raw, words):
    with pytest.raises(MaruConfigError, match=words):
        parse_config(raw)


def test_chunk_tokens_are_aligned_to_the_block_size_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_config({**BASE, "maru_kv_chunk_tokens": 200}, block_size=128)
    assert cfg.maru_kv_chunk_tokens == 256
    assert "not a multiple" in caplog.text


def test_token_file_is_read(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert parse_config({**BASE, "maru_token_file": str(token)}).resolve_token() == "s3cret"
    with pytest.raises(MaruConfigError, match="cannot be read"):
        parse_config({**BASE, "maru_token_file": str(tmp_path / "none")}).resolve_token()


def test_make_kv_transfer_config_is_accepted_by_vllm():
    d = make_kv_transfer_config("tcp://127.0.0.1:7000", "/dev/shm/p", async_load=True,
                                maru_use_layerwise=True)
    cfg = KVTransferConfig(**d)
    assert cfg.kv_connector == "MaruKVConnector"
    assert cfg.kv_connector_module_path == "maru_connector"
    assert cfg.kv_load_failure_policy == "recompute"
    assert cfg.kv_connector_extra_config["maru_async_load"] is True
    with pytest.raises(MaruConfigError, match="maru_async_laod"):
        make_kv_transfer_config("tcp://127.0.0.1:7000", "/dev/shm/p", async_laod=True)
