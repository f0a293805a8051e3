"""Offsets validation: every malformed offsets tensor is refused, naming the argument."""

import pytest
import torch
from gem_jagged._checks import LengthRange, check_offsets, check_tokens


@pytest.mark.parametrize(
    "offsets, message",
    [
        (torch.tensor([[0, 1]]), "must be 1-D"),
        (torch.tensor([0.0, 1.0]), "int32 or int64"),
        (torch.tensor([], dtype=torch.int64), "at least one entry"),
        (torch.tensor([1, 2]), r"\[0\] must be 0"),
        (torch.tensor([0, 3, 2]), "non-decreasing"),
        ([0, 1], "torch.Tensor"),
    ],
)
def test_bad_offsets_are_refused_with_the_argument_named(offsets, message):
    with pytest.raises((ValueError, TypeError), match=message):
        check_offsets("q_offsets", offsets, validate_values=True)
    with pytest.raises((ValueError, TypeError), match="q_offsets"):
        check_offsets("q_offsets", offsets, validate_values=True)


def test_values_read_give_the_length_range():
    assert check_offsets("o", torch.tensor([0, 2, 2, 9]), validate_values=True) == LengthRange(
        0, 7, 9
    )
    assert check_offsets("o", torch.tensor([0]), validate_values=True) == LengthRange(0, 0, 0)
    assert check_offsets("o", torch.tensor([5, 1]), validate_values=False) is None


def test_offsets_must_end_at_the_token_count():
    with pytest.raises(ValueError, match=r"q_offsets\[-1\] = 3 must equal the number of tokens"):
        check_tokens("q_offsets", LengthRange(0, 3, 3), 4, values="q")
    check_tokens("q_offsets", None, 4, values="q")  # unknown (inside a capture): nothing to say
