"""Workers agree on each step's parameters: names, shapes, dtypes, re-creations.

Through DistributedOptimizer (the Pyro front end) and through
ParameterAgreement itself, with tensors and names chosen by the test.
"""

from __future__ import annotations

import time

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.exchange.agreement import (
    DIGEST_FLOATS,
    MAX_SUMMED_WORKERS,
    ParameterAgreement,
    broadcast_values_,
    digest_bits,
    digest_floats,
    digests_equal,
)

from ..support.harness import ENGINES, CountingEngine, run_workers
from ..support.models import regression_data


def _extra_param_on_worker_one() -> tuple[str, str, float]:
    x, y = regression_data(pd.rank(), 8)

    def guide(x: torch.Tensor, y: torch.Tensor) -> None:
        pyro.param("common", torch.zeros(2))
        if pd.rank() == 1:
            pyro.param("extra", torch.zeros(2))

    def model(x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    svi = SVI(model, guide, pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1})), Trace_ELBO())
    start = time.monotonic()
    try:
        svi.step(x, y)
    except pd.PyroDistributedError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_differing_param_sets_raise_on_every_worker_quickly() -> None:
    results = run_workers(_extra_param_on_worker_one)
    for kind, message, elapsed in results:
        assert kind == "PyroDistributedError"
        assert "'extra'" in message
        assert "is used on worker 1" in message
        assert "param store of worker 0" in message
        assert elapsed < 5.0, f"took {elapsed:.1f} s; the engine time-out is 30 s"
    assert results[0][1] == results[1][1]


def _param_shape_per_worker() -> str:
    p = pyro.param("p", torch.zeros(2 + pd.rank())).unconstrained()
    p.sum().backward()
    try:
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))([p])
    except pd.PyroDistributedError as err:
        return str(err)
    return "no error"


def test_shape_mismatch_names_param_and_shapes() -> None:
    messages = run_workers(_param_shape_per_worker)
    assert messages[0] == messages[1]
    assert "'p' differs in shape or dtype" in messages[0]
    assert "worker 0: shape [2]" in messages[0] and "worker 1: shape [3]" in messages[0]


def dtype_mismatch() -> str:
    dtype = torch.float32 if pd.rank() == 0 else torch.float64
    p = pyro.param("p", torch.zeros(2, dtype=dtype)).unconstrained()
    p.sum().backward()
    with pytest.raises(pd.PyroDistributedError) as info:
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))([p])
    return str(info.value)


@pytest.mark.parametrize("engine", ENGINES)
def test_dtype_mismatch_names_param_and_dtypes(engine: str) -> None:
    message = run_workers(dtype_mismatch, engine=engine)[0]
    assert "'p' differs in shape or dtype" in message
    assert "worker 0: shape [2], torch.float32" in message
    assert "worker 1: shape [2], torch.float64" in message


# --- ParameterAgreement itself, with plain tensors ---------------------------------------------


def test_summed_digests_show_any_disagreement() -> None:
    def summed(*digests: int) -> list[float]:
        columns = zip(*(digest_floats(d) for d in digests), strict=True)
        return [sum(column) for column in columns]

    same = 0x1234_5678_9ABC_DEF0
    assert digests_equal(summed(same, same, same), 3)
    # Bytes 1 and 3 against 2 and 2: equal sums, so only the squares tell.
    assert not digests_equal(summed(0x01, 0x03), 2)
    assert not digests_equal(summed(same, same, same ^ (1 << 61)), 3)


def test_digest_floats_stay_exact_in_a_float32_sum_up_to_the_documented_worker_count() -> None:
    digest = 2**64 - 1  # every byte 0xFF: the largest squares any byte can give
    floats = digest_floats(digest)
    assert len(floats) == DIGEST_FLOATS
    sums = (torch.tensor(floats, dtype=torch.float32) * MAX_SUMMED_WORKERS).tolist()
    assert digests_equal(sums, MAX_SUMMED_WORKERS)
    # Two pairs of workers that disagree on the lowest byte only.
    mixed = [digest_floats(digest), digest_floats(digest - 1)] * 2
    assert not digests_equal([sum(column) for column in zip(*mixed, strict=True)], 4)


def test_digest_pieces_are_as_wide_as_the_wire_type_sums_exactly() -> None:
    assert digest_bits(torch.float32, 2) == 8
    assert digest_bits(torch.float32, MAX_SUMMED_WORKERS) == 8
    assert digest_bits(torch.float32, MAX_SUMMED_WORKERS + 1) == 4
    assert digest_bits(torch.float16, 2) == 4  # 2 x 15**2 <= 2048 < 2 x 255**2
    assert digest_bits(torch.float16, 9) == 4
    assert digest_bits(torch.float16, 10) == 2
    assert digest_bits(torch.float16, 2048) == 1
    assert digest_bits(torch.float16, 2049) is None  # even flags of 0 or 1 would not add up
    assert digest_bits(torch.bfloat16, 2) == 2
    assert digest_bits(torch.int64, 2) is None


@pytest.mark.parametrize(("dtype", "workers"), [(torch.float16, 9), (torch.bfloat16, 28)])
def test_digest_pieces_summed_in_a_narrow_type_still_show_disagreement(
    dtype: torch.dtype, workers: int
) -> None:
    """Summed one worker at a time in the narrow type, as a wire of that type is."""
    bits = digest_bits(dtype, workers)
    assert bits is not None

    def summed(digests: list[int]) -> list[float]:
        total = torch.zeros(2 * 64 // bits, dtype=dtype)
        for digest in digests:
            total = total + torch.tensor(digest_floats(digest, bits), dtype=dtype)
        return total.tolist()

    largest = 2**64 - 1  # every piece at its largest: the largest sums
    assert len(digest_floats(largest, bits)) == 2 * 64 // bits
    assert digests_equal(summed([largest] * workers), workers)
    assert not digests_equal(summed([largest] * (workers - 1) + [largest - 1]), workers)
    assert not digests_equal(summed([0x1] * (workers - 1) + [0x2]), workers)


def agreement_steps() -> dict[str, object]:
    engine = CountingEngine(pd.current_engine())
    agreement = ParameterAgreement(engine, cap_bytes=1 << 20, catalog_name="catalog")
    a = torch.full((3,), float(pd.rank() + 1))
    b = torch.full((2,), 10.0 * (pd.rank() + 1))
    catalog = {"a": a, "b": b}
    record: dict[str, object] = {}

    first = agreement.settle(agreement.propose({"a": a}), lambda: catalog, riders=[pd.rank()])
    record["first"] = (first.step.names, first.unchanged, first.riders, list(engine.calls))
    record["a_after_first"] = a.clone()

    engine.calls.clear()
    again = agreement.settle(agreement.propose({"a": a}), lambda: catalog)
    record["again"] = (again.step.names, again.unchanged, list(engine.calls))

    # Worker 1 also steps "b", which worker 0 has in its catalog but was not given.
    given = {"a": a, "b": b} if pd.rank() == 1 else {"a": a}
    mixed = agreement.settle(agreement.propose(given), lambda: catalog)
    record["mixed"] = (mixed.step.names, sorted(mixed.step.borrowed), mixed.unchanged)
    record["b_after_mixed"] = b.clone()
    record["same_objects"] = all(
        t is catalog[n] for n, t in zip(mixed.step.names, mixed.step.tensors, strict=True)
    )

    agreement = ParameterAgreement(engine, cap_bytes=1 << 20, catalog_name="catalog")  # anew
    engine.calls.clear()
    forgotten = agreement.settle(agreement.propose({"a": a, "b": b}), lambda: catalog)
    record["forgotten"] = (forgotten.unchanged, list(engine.calls))
    return record


def test_parameter_agreement_syncs_new_tensors_borrows_and_forgets() -> None:
    results = run_workers(agreement_steps)
    for rank, record in enumerate(results):
        # First step: every tensor is new; worker 0's values are broadcast.
        names, unchanged, riders, calls = record["first"]
        assert (names, unchanged, riders) == (("a",), False, [1])
        assert calls == [("allreduce_max", 1), ("broadcast", 1)]
        assert torch.equal(record["a_after_first"], torch.full((3,), 1.0)), rank
        # Same tensors again: one header collective, nothing new.
        assert record["again"] == (("a",), True, [("allreduce_max", 1)])
        # "b" joins the step on worker 0 from its catalog, and is borrowed there only.
        names, borrowed, unchanged = record["mixed"]
        assert names == ("a", "b") and not unchanged
        assert borrowed == (["b"] if rank == 0 else [])
        assert torch.equal(record["b_after_mixed"], torch.full((2,), 10.0)), rank
        assert record["same_objects"]
        # After forget() every tensor is new again and is broadcast once more.
        unchanged, calls = record["forgotten"]
        assert not unchanged
        assert ("broadcast", 1) in calls


def agreement_failure(case: str) -> str:
    agreement = ParameterAgreement(pd.current_engine(), 1 << 20, catalog_name="optimizer")
    p = torch.zeros(2)
    if case == "missing":
        catalog = {"p": p, "q": torch.zeros(1)} if pd.rank() == 1 else {"p": p}
        given = catalog
    else:  # "recreated": after one synchronised step, worker 1 makes a new tensor
        agreement.settle(agreement.propose({"p": p}), lambda: {"p": p})
        if pd.rank() == 1:
            p = torch.zeros(2)
        catalog = given = {"p": p}
    with pytest.raises(pd.PyroDistributedError) as info:
        agreement.settle(agreement.propose(given), lambda: catalog)
    return str(info.value)


def test_parameter_agreement_names_the_catalog_and_the_workers() -> None:
    missing = run_workers(agreement_failure, "missing")
    assert missing[0] == missing[1]
    assert (
        "parameter 'q' is used on worker 1 but does not exist in the optimizer of worker 0"
        in missing[0]
    )
    recreated = run_workers(agreement_failure, "recreated")
    assert recreated[0] == recreated[1]
    assert "parameter 'p' was re-created on worker 1 only" in recreated[0]
    assert "it is still the synchronised one on worker 0" in recreated[0]


def test_what_is_new_follows_the_synchronised_tensors() -> None:
    agreement = ParameterAgreement(pd.current_engine(), cap_bytes=1 << 20)
    a, b = torch.zeros(3), torch.zeros(2)
    given = {"b": b, "a": a}
    first = agreement.propose(given)
    assert first.names == ("a", "b") and first.new == ("a", "b")
    assert first.step.tensors == (a, b)
    agreement.settle(first, lambda: given)  # both synchronised: nothing is new now
    steady = agreement.propose(given)
    assert steady.new == () and steady.digest != first.digest
    assert agreement.accept(steady).tensors == (a, b)
    # A replaced tensor, or a renamed one, is new.
    assert agreement.propose({"b": torch.zeros(2), "a": a}).new == ("b",)
    assert agreement.propose({"c": b, "a": a}).new == ("c",)
    assert agreement.propose(given).digest == steady.digest
    fresh = ParameterAgreement(pd.current_engine(), cap_bytes=1 << 20)  # a new epoch's
    assert fresh.propose(given).new == ("a", "b")


def _broadcast_from_worker_zero() -> list[list[float]]:
    rank = pd.rank()
    tensors = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank), torch.tensor(rank)]
    broadcast_values_(pd.current_engine(), tensors, cap_bytes=8)  # several buffers
    return [t.reshape(-1).tolist() for t in tensors]


def test_broadcast_values_gives_every_worker_worker_zeros_values_in_place() -> None:
    for values in run_workers(_broadcast_from_worker_zero, world_size=3):
        assert values == [[0.0, 0.0], [10.0, 10.0, 10.0], [0]]
