"""``kvstore route``: an OpenAI-compatible router in front of a prefill server (the producer)
and a decode server (the consumer). Per request it predicts whether prefilling on the producer
and sending the KV over the link beats prefilling on the consumer (decision.py), from
estimates it keeps measuring (estimates.py), and runs the request that way (service.py) behind
an HTTP front (front.py). It speaks HTTP only: no engine is imported. The ``kv_transfer_params``
it exchanges with the servers are documented in docs/vllm.md ("Prefill and decode on different
servers")."""
