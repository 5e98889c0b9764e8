"""What crosses between the gateway and a pool worker is plain data (``cluster/messages.py``): a
request comes back from its dict as it was, the first token's sampling included."""
from __future__ import annotations

import json

from kv_transfer.base import Route
from prefill_server.cluster.messages import request_from_dict, request_to_dict
from prefill_server.engine.types import PrefillRequest, SamplingParams


def test_a_request_survives_its_dict():
    s = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11, min_p=0.05, repetition_penalty=1.2,
                       logit_bias=((4, -2.5), (7, 100.0)), allowed_token_ids=(4, 7, 9), banned_token_ids=(2, 9),
                       sampler="sglang")
    for sampling in (s, SamplingParams()):
        for salt in ("tenant-a", None):
            r = PrefillRequest("r1", (1, 2, 3), sampling, route=Route.STREAM, num_logprobs=2, room_tokens=1,
                               decode_url="http://d:1", cache_salt=salt)
            assert request_from_dict(json.loads(json.dumps(request_to_dict(r)))) == r
