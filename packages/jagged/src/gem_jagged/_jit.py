"""``jit``: ``triton.jit`` that does not specialise a kernel on the batch-dependent integers.

Triton compiles a kernel once per combination of the "specialisations" of its arguments: an
integer equal to 1 or divisible by 16, a pointer aligned to 16 bytes. For strides and head
counts, fixed per model, that knowledge lets the compiler vectorise loads and is worth a variant.
Token counts, sequence counts and work-list sizes change with every jagged batch: specialising on
them compiled a fresh variant of an attention kernel (a few hundred ms of host time) whenever a
batch landed on a combination not seen before, and a training step of gem-small then ran
several times slower than its kernels for dozens of steps (``docs/design/jagged.md``).

Every kernel of the package is declared through this ``jit``, which leaves the arguments with
the names below unspecialised (names absent from a kernel's signature are ignored). The work
lists keep their own pointers aligned (``gem_jagged._worklist.SLOT_MULTIPLE``).
"""

import functools

import triton

__all__ = ["BATCH_DEPENDENT", "jit"]

BATCH_DEPENDENT = (
    "total_q",
    "total_k",
    "num_seqs",
    "num_slots",
    "num_tiles",
    "num_items",
    "search_steps",
    "max_splits",
)

jit = functools.partial(triton.jit, do_not_specialize=BATCH_DEPENDENT)
