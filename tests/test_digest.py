"""The one digest (pyro_distributed.digest): equal values give equal digests,
and any difference in bits, dtype, shape or structure gives another."""

from __future__ import annotations

import torch

from pyro_distributed.digest import digest, digest_int


def test_equal_values_have_equal_digests_across_copies() -> None:
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).reshape(2, 3), "lr": 0.1}
    copy = {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
    assert digest(state) == digest(copy)
    assert len(digest(state)) == 16


def test_bits_dtype_shape_and_structure_all_count() -> None:
    base = torch.zeros(4)
    variants = [
        torch.tensor([-0.0, 0.0, 0.0, 0.0]),  # equal as numbers, not as bits
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(2, 2),
        [torch.zeros(2), torch.zeros(2)],
        {"a": torch.zeros(4)},
    ]
    seen = {digest(base)}
    for variant in variants:
        seen.add(digest(variant))
    assert len(seen) == len(variants) + 1


def test_mappings_are_read_in_key_order() -> None:
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest(("a", "b")) != digest(("b", "a"))


def test_digest_int_fits_an_int64_with_its_negation() -> None:
    for value in [(), ("p",), (("p", "q"), [("p", ((3,), "torch.float32"))])]:
        number = digest_int(value)
        assert 0 <= number < 2**62
        assert number == digest_int(value)
    assert digest_int(("p",)) != digest_int(("q",))
