"""KV transfer from the prefill server's pool to decode engines (see ``kv_transfer.base``)."""
