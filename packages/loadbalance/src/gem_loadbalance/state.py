"""The shuffler's saved state: its fields, their checks, and the digest of what it has read.

A ``BaseBatchShuffler`` never serializes samples; on resume it re-reads its source from the start
up to the saved point. That is exact only if the source is the one the state was saved over and
the state is intact, and neither is visible from the shapes alone: another source with the same
sub-batch sizes, or a pool cost flipped to NaN, would replay without complaint and then yield
batches that differ from the uninterrupted run's. So the state carries ``source_digest``, a
BLAKE2b hash of every sub-batch the shuffler read (its sample count and the float64 costs its
pricing function gave), and ``check_state`` checks every field on load (presence, type, range and
the relations between fields). The replay re-prices what it re-reads and compares the digest, the
pool's costs and the running sums with the saved ones, naming the first field that differs.
"""

import hashlib
from numbers import Integral, Real

import numpy as np

__all__ = ["STATE_KEYS", "STATE_VERSION", "SourceDigest", "check_state"]

STATE_VERSION = 2
STATE_KEYS = (
    "version", "config", "step", "consumed_samples", "consumed_sub_batches", "source_digest",
    "pool_positions", "pool_costs", "cost_sum", "cost_count", "delay_counts", "emitted",
    "last_target", "last_cost", "agreed_cost",
)  # fmt: skip
_COUNTS = ("step", "consumed_samples", "consumed_sub_batches", "cost_count", "emitted")
_AMOUNTS = ("cost_sum", "last_target", "last_cost")


class SourceDigest:
    """A running BLAKE2b digest of the sub-batches read: sample count and float64 costs of each."""

    def __init__(self):
        self._hash = hashlib.blake2b(digest_size=16)

    def update(self, costs: np.ndarray) -> None:
        """Add one sub-batch's costs (float64 ``[samples]``)."""
        self._hash.update(np.int64(costs.size).tobytes())
        self._hash.update(np.ascontiguousarray(costs, dtype="<f8").tobytes())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _count(state: dict, name: str) -> int:
    value = state[name]
    if not isinstance(value, Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"state field {name!r} must be an integer >= 0, got {value!r}")
    return int(value)


def _amount(name: str, value) -> float:
    if not isinstance(value, Real) or isinstance(value, bool) or not np.isfinite(value):
        raise ValueError(f"state field {name!r} must be a finite number >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"state field {name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_state(state, *, config: dict) -> dict:
    """Check a saved state's fields and return it with plain Python values.

    Args:
        state: what ``BaseBatchShuffler.state_dict()`` returned, possibly through JSON.
        config: the resuming shuffler's configuration (``dataclasses.asdict(ShufflerConfig)``).

    Returns:
        A new dict with every key of ``STATE_KEYS``: counts as ``int``, costs as ``float``,
        ``delay_counts`` keyed by ``int``.

    Raises:
        ValueError: ``state`` is not a dict, lacks a key (named), is of another version, was
            saved under another configuration, or has a field (named) of the wrong type, out of
            range or inconsistent with the others.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict saved by state_dict(), got {type(state).__name__}")
    if "version" not in state:
        raise ValueError("state is missing key 'version': it was not saved by state_dict()")
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"state must be saved by state_dict() of version {STATE_VERSION}, got version "
            f"{state['version']!r}"
        )
    for key in STATE_KEYS:
        if key not in state:
            raise ValueError(f"state is missing key {key!r} (state_dict() saves {STATE_KEYS})")
    if state["config"] != config:
        raise ValueError(f"state field 'config' is {state['config']}, this shuffler has {config}")
    out = {"version": STATE_VERSION, "config": dict(config)}
    out |= {name: _count(state, name) for name in _COUNTS}
    out |= {name: _amount(name, state[name]) for name in _AMOUNTS}
    digest = state["source_digest"]
    if not isinstance(digest, str) or len(digest) != 32:
        raise ValueError(
            f"state field 'source_digest' must be a 32-character hex string, got {digest!r}"
        )
    out["source_digest"] = digest
    agreed = state["agreed_cost"]
    out["agreed_cost"] = None if agreed is None else _amount("agreed_cost", agreed)
    positions, costs = state["pool_positions"], state["pool_costs"]
    if not isinstance(positions, list | tuple) or not isinstance(costs, list | tuple):
        raise ValueError("state fields 'pool_positions' and 'pool_costs' must be lists")
    if len(positions) != len(costs):
        raise ValueError(
            f"state is corrupt: pool_positions ({len(positions)}) and pool_costs ({len(costs)}) "
            "differ in length"
        )
    for p in positions:
        if not isinstance(p, Integral) or isinstance(p, bool):
            raise ValueError(f"state field 'pool_positions' must hold integers, got {p!r}")
    positions = [int(p) for p in positions]
    consumed = out["consumed_samples"]
    if positions and (positions[0] < 0 or positions[-1] >= consumed):
        raise ValueError(
            f"state field 'pool_positions' must lie in [0, consumed_samples={consumed}), got "
            f"{positions[0]} ... {positions[-1]}"
        )
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
        raise ValueError("state field 'pool_positions' must be strictly increasing")
    out["pool_positions"] = positions
    out["pool_costs"] = [_amount("pool_costs", c) for c in costs]
    delays = state["delay_counts"]
    if not isinstance(delays, dict):
        raise ValueError(f"state field 'delay_counts' must be a dict, got {delays!r}")
    try:
        out["delay_counts"] = {int(k): v for k, v in delays.items()}
    except (TypeError, ValueError):
        raise ValueError(
            f"state field 'delay_counts' must be keyed by integers, got {delays}"
        ) from None
    for v in out["delay_counts"].values():
        if not isinstance(v, Integral) or isinstance(v, bool) or v < 0:
            raise ValueError(f"state field 'delay_counts' must count >= 0, got {delays}")
    if out["emitted"] != consumed - len(positions):
        raise ValueError(
            f"state field 'emitted' is {out['emitted']} but consumed_samples − pool = "
            f"{consumed - len(positions)}"
        )
    if sum(out["delay_counts"].values()) != out["emitted"]:
        raise ValueError(
            f"state field 'delay_counts' counts {sum(out['delay_counts'].values())} samples, "
            f"emitted is {out['emitted']}"
        )
    if out["cost_count"] != consumed:
        raise ValueError(
            f"state field 'cost_count' is {out['cost_count']}, consumed_samples is {consumed}"
        )
    return out
