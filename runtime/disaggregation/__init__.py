"""Prefill/decode disaggregation (docs/disaggregation.md): a prefill server computes a prompt and sends
its KV (and per-request state) with the first token to a decode server, which continues the request.

    config.py     the `conduit serve --disaggregation-*` flags
    protocol.py   the frames on the control connection (prefill -> decode's bootstrap port)
    base.py       the transfer backend contract + registry, KVSender (prefill) and KVReceiver (decode)
    tcp.py shm.py nccl.py nixl.py mooncake.py   the backends
    worker.py     the worker's side: export after the first token (prefill), import into reserved slots (decode)
    scheduler.py  the scheduler's side: hold the prefill's answer until sent; reserve pages on decode

The gateway pairs servers: runtime/http/gateway/pd.py."""
