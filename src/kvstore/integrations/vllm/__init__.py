"""vLLM on top of the store: ``KVStoreConnector``, a vLLM v1 KV connector.

Importing this module imports vLLM (``import kvstore`` alone never does). See
:mod:`kvstore.integrations.vllm.connector` for how to turn it on, and ``docs/vllm.md``.
"""

from kvstore.integrations.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
