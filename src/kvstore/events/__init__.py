"""KV events from the store, in vLLM's format (docs/store.md, "KV events").

``records`` holds the wire format (vLLM's ``KVEventBatch`` of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``); it needs ``msgspec`` (the ``events`` extra, also a
dependency of vLLM), as the publisher needs ``pyzmq``: this package imports neither until a
module that uses them is imported.
"""
