import torch

from prefill_server.engine.sampling import sample_first_token
from prefill_server.engine.types import SamplingParams


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_first_token(logits, SamplingParams()) == 1
    p = SamplingParams(temperature=1.0, seed=7)
    assert sample_first_token(logits, p) == sample_first_token(logits, p)
    # top_k=1 is greedy whatever the temperature
    assert sample_first_token(logits, SamplingParams(temperature=5.0, top_k=1)) == 1
    # a tiny top_p keeps only the top token
    assert sample_first_token(logits, SamplingParams(temperature=5.0, top_p=0.01)) == 1


def test_extreme_parameters_do_not_crash():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_first_token(logits, SamplingParams(temperature=1e-9)) == 1
    assert sample_first_token(logits, SamplingParams(temperature=1.0, top_p=1e-40, seed=1)) == 1
