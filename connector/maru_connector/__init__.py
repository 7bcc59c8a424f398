"""MaruCache's vLLM KV connector.

vLLM loads it with ``"kv_connector": "MaruKVConnector"`` and
``"kv_connector_module_path": "maru_connector"``;
:func:`maru_connector.config.make_kv_transfer_config` builds that config.
The connector class is imported on first use, so the configuration helpers
work without importing vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maru_connector.connector import MaruKVConnector

__all__ = ["MaruKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "MaruKVConnector":
        from maru_connector.connector import MaruKVConnector

        return MaruKVConnector
    raise AttributeError(f"module 'maru_connector' has no attribute {name!r}")
