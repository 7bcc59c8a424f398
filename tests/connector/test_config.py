"""Strict parsing of kv_connector_extra_config and the generated kv-transfer-config."""

from __future__ import annotations

import logging
import pathlib
import re
import threading
import time

import pytest
from vllm.config import KVTransferConfig

from maru_connector.config import MaruConfigError, make_kv_transfer_config, parse_config
from maru_core.connector_config import DEPRECATED_KEYS, KNOB_NAMES
from maru_core.storage_format import StorageFormat

DOCS = pathlib.Path(__file__).parents[2] / "docs" / "connector.md"

BASE = {"maru_index_url": "tcp://127.0.0.1:7000", "maru_pool_path": "/dev/shm/p"}


def test_defaults():
    cfg = parse_config(BASE, block_size=128)
    assert cfg.maru_kv_chunk_tokens == 256 and not cfg.maru_use_layerwise
    assert not cfg.maru_async_load and cfg.maru_async_store
    assert cfg.fmt_name == "chunkwise" and cfg.storage_format is StorageFormat.CHUNKWISE


def test_unknown_key_names_the_key_and_the_closest_known_one():
    with pytest.raises(MaruConfigError, match=r"'maru_use_layerwize'.*did you mean 'maru_use_layerwise' "
                                              r"\(deprecated: write 'maru_format'\)"):
        parse_config({**BASE, "maru_use_layerwize": True})
    with pytest.raises(MaruConfigError, match=r"'maru_fromat'.*did you mean 'maru_format'"):
        parse_config({**BASE, "maru_fromat": "layerwise"})


@pytest.mark.parametrize("fmt", list(StorageFormat))
def test_maru_format_names_the_storage_format(fmt):
    cfg = parse_config({**BASE, "maru_format": fmt.value})
    assert cfg.storage_format is fmt and cfg.fmt_name == fmt.value
    assert cfg.maru_use_layerwise is (fmt is StorageFormat.LAYERWISE)  # the old attribute still reads right


def test_an_unknown_format_lists_the_formats():
    with pytest.raises(MaruConfigError, match=r"maru_format.*'rowwise'.*'chunkwise', 'layerwise'"):
        parse_config({**BASE, "maru_format": "rowwise"})
    with pytest.raises(MaruConfigError, match=r"maru_format"):
        parse_config({**BASE, "maru_format": True})


@pytest.mark.parametrize("layerwise, fmt", [(True, StorageFormat.LAYERWISE), (False, StorageFormat.CHUNKWISE)])
def test_the_older_layerwise_flag_still_picks_the_format_without_a_warning(layerwise, fmt, caplog):
    # The operator writes this spelling on purpose (older connectors read only it): no warning.
    with caplog.at_level(logging.WARNING):
        cfg = parse_config({**BASE, "maru_use_layerwise": layerwise})
    assert cfg.storage_format is fmt and cfg.maru_use_layerwise is layerwise
    assert "maru_use_layerwise" not in caplog.text
    assert parse_config({**BASE, "maru_use_layerwise": layerwise, "maru_format": fmt.value}).storage_format is fmt


def test_a_conflict_between_the_flag_and_the_format_says_which_to_remove():
    with pytest.raises(MaruConfigError, match=r"contradicts maru_format.*remove maru_use_layerwise"):
        parse_config({**BASE, "maru_use_layerwise": True, "maru_format": "chunkwise"})
    with pytest.raises(MaruConfigError, match=r"maru_use_layerwise.*true or false.*maru_format"):
        parse_config({**BASE, "maru_use_layerwise": "layerwise"})


def test_the_knob_table_lists_every_knob():
    """docs/connector.md's knob table: every knob of the one definition, the deprecated keys, nothing else."""
    text = DOCS.read_text().split("## Knobs", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(maru_[a-z_]+)`", "\n".join(l.split("|")[1] for l in text.splitlines()
                                                               if l.startswith("| `"))))
    assert documented == set(KNOB_NAMES) | set(DEPRECATED_KEYS)


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


def test_with_a_sidecar_a_token_file_written_later_is_waited_for(tmp_path, monkeypatch):
    """A pod credential is written by the sidecar at start, maybe after vLLM started."""
    monkeypatch.setattr("maru_connector.config.TOKEN_FILE_WAIT_S", 2.0)
    credential = tmp_path / "credential"
    knobs = {"maru_sidecar_socket": str(tmp_path / "sidecar.sock"), "maru_cache_name": "c1",
             "maru_token_file": str(credential)}
    writer = threading.Timer(0.3, credential.write_text, args=("maru-pod-v1:ns/pod:ab\n",))
    writer.start()
    try:
        assert parse_config(knobs).resolve_token() == "maru-pod-v1:ns/pod:ab"
    finally:
        writer.cancel()
    monkeypatch.setattr("maru_connector.config.TOKEN_FILE_WAIT_S", 0.2)
    with pytest.raises(MaruConfigError, match=r"no such file after 0.2 s.*--credential-file"):
        parse_config({**knobs, "maru_token_file": str(tmp_path / "never")}).resolve_token()


def test_without_a_sidecar_a_missing_token_file_is_an_error_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr("maru_connector.config.TOKEN_FILE_WAIT_S", 30.0)
    started = time.monotonic()
    with pytest.raises(MaruConfigError, match="cannot be read"):
        parse_config({**BASE, "maru_token_file": str(tmp_path / "none")}).resolve_token()
    assert time.monotonic() - started < 5


def test_make_kv_transfer_config_is_accepted_by_vllm():
    d = make_kv_transfer_config("tcp://127.0.0.1:7000", "/dev/shm/p", async_load=True,
                                maru_use_layerwise=True)
    cfg = KVTransferConfig(**d)
    assert cfg.kv_connector == "MaruKVConnector"
    assert cfg.kv_connector_module_path == "maru_connector"
    assert cfg.kv_load_failure_policy == "recompute"
    assert cfg.kv_connector_extra_config["maru_async_load"] is True
    assert cfg.kv_connector_extra_config["maru_format"] == "layerwise"  # the deprecated flag, written anew
    assert "maru_use_layerwise" not in cfg.kv_connector_extra_config
    with pytest.raises(MaruConfigError, match="maru_async_laod"):
        make_kv_transfer_config("tcp://127.0.0.1:7000", "/dev/shm/p", async_laod=True)
