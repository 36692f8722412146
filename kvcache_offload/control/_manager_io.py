"""What the manager takes in and hands out: key checks, and its outputs built without their
Python constructors (compiled with the manager, the classes below are C statics)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingEvent, PrepareStoreOutput
from kvcache_offload.contracts.offload_key import OffloadKey, validate_offload_key
from kvcache_offload.control.policies.base import BlockStatus
from kvcache_offload.errors import BlockStateError

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

__all__ = [
    "MEDIUM",
    "blocks_at_least",
    "check_keys",
    "cpu_spec",
    "event",
    "raise_overdrawn",
    "state_name",
    "store_output",
]

MEDIUM = "CPU"

# Final: compiled, these are C statics, not a module-dict lookup per use.
_new_object: Final = object.__new__
_SPEC_CLASS: Final = CPULoadStoreSpec
_OUTPUT_CLASS: Final = PrepareStoreOutput
_EVENT_CLASS: Final = OffloadingEvent


def cpu_spec(block_ids: list[object]) -> CPULoadStoreSpec:
    """``CPULoadStoreSpec.from_owned_list(block_ids)``, built here: the spec and the output
    classes are interpreted (numpy), and their constructors' Python frames cost more than
    the rest of a small store (tests check the result stays equal to theirs)."""
    spec: Any = _new_object(_SPEC_CLASS)
    spec._owned_ids = block_ids
    spec._block_ids = None
    return cast(CPULoadStoreSpec, spec)


def event(keys: list[OffloadKey], removed: bool) -> OffloadingEvent:
    """``OffloadingEvent(keys, MEDIUM, removed)`` without its Python ``__init__`` (a plain
    dataclass of these three fields: a test checks it stays one). A store that evicts makes
    two of them, and the constructor's frame cost 1-3 us of its 3-6 us on the development
    VM, on the path of every ``await engine.store``."""
    event: Any = _new_object(_EVENT_CLASS)
    event.keys = keys
    event.medium = MEDIUM
    event.removed = removed
    return cast(OffloadingEvent, event)


def store_output(
    keys_to_store: list[OffloadKey], spec: CPULoadStoreSpec, evicted_keys: list[OffloadKey]
) -> PrepareStoreOutput:
    """``PrepareStoreOutput(keys_to_store, spec, evicted_keys)`` without its Python
    ``__init__`` (a plain dataclass of these three fields: a test checks it stays one)."""
    output: Any = _new_object(_OUTPUT_CLASS)
    output.keys_to_store = keys_to_store
    output.store_spec = spec
    output.evicted_keys = evicted_keys
    return cast(PrepareStoreOutput, output)


def check_keys(keys: Sequence[object]) -> None:
    """Raise InvalidKeyError for the first malformed key. Typed ``object``: compiled, a loop
    over ``OffloadKey`` items would raise a bare TypeError before this check named the key."""
    if type(keys) is list:  # the usual case: compiled, an indexed loop, no iterator object
        for key in keys:
            if type(key) is not bytes or len(key) <= 4:
                validate_offload_key(key)
        return
    for key in keys:
        if type(key) is not bytes or len(key) <= 4:
            validate_offload_key(key)


def state_name(block: BlockStatus | None) -> str:
    if block is None:
        return "absent"
    return "being written" if block.ref_cnt < 0 else "idle" if block.ref_cnt == 0 else "being read"


def blocks_at_least(
    m: CPUOffloadingManager, keys: Sequence[OffloadKey], min_ref_cnt: int, action: str, wanted: str
) -> list[BlockStatus]:
    """The blocks of ``keys``, checked before anything changes: BlockStateError unless
    every one is present with ``ref_cnt >= min_ref_cnt`` (0: ready, 1: being read)."""
    table = m._blocks
    blocks = []
    # Compiled: no cast to bytes before the check, and a list (the usual argument) is
    # walked by index, not through a generic iterator step per key.
    items: list[Any] = keys if isinstance(keys, list) else list(keys)
    for key in items:
        if type(key) is not bytes:
            check_keys((key,))  # InvalidKeyError, unless a bytes subclass: then usable
        block = table.get(key)  # compiled: one C call; a bound ``get`` is a generic call
        if block is None and m._ahead:
            block = m._ahead.get(key)
        if block is None or block.ref_cnt < min_ref_cnt:
            # A malformed key anywhere is named before a state error (a bytes key found
            # in the table equals a stored, valid one, so only these need the full check).
            check_keys(keys)
            raise BlockStateError(
                f"cannot {action} key {key.hex()}: it is {state_name(block)}, not {wanted}"
            )
        blocks.append(block)
    return blocks


def raise_overdrawn(table: dict[OffloadKey, BlockStatus], keys: Sequence[OffloadKey]) -> None:
    """Name the key of a load completion listed more often than it has loads in flight."""
    for key, count in Counter(keys).items():
        ref_cnt = table[key].ref_cnt
        if count > ref_cnt:
            raise BlockStateError(
                f"cannot complete {count} loads of key {key.hex()}: only {ref_cnt} in flight"
            )
