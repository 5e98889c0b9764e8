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


def test_banned_tokens_are_never_drawn():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_first_token(logits, SamplingParams(banned_token_ids=(1,))) == 2
    assert sample_first_token(logits, SamplingParams(banned_token_ids=(1, 2, 99, -3))) == 0  # (outside: ignored)
    for seed in range(20):
        p = SamplingParams(temperature=2.0, seed=seed, banned_token_ids=(1, 2))
        assert sample_first_token(logits, p) in (0, 3)
    assert logits[1] == 3.0  # (the caller's row is left as it was: logprobs are taken from it)


def test_banning_every_token_is_a_clear_error():
    import pytest

    from prefill_server.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="min_tokens"):
        sample_first_token(torch.tensor([0.1, 3.0]), SamplingParams(banned_token_ids=(0, 1)))
