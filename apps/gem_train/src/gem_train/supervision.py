"""A worker that outlives its ``torchrun`` agent stops.

``torchrun``'s agent starts each worker as its child and is what restarts, or ends, the group
when one fails. Killed with ``kill -9``, the agent takes none of that with it: its workers are
re-parented (to init, or a subreaper) and would train on to the end, unsupervised, writing
checkpoints that nobody is waiting for. A ``Supervision`` remembers the parent it started under
and, checked at every step (``os.getppid``, a system call of well under a microsecond), raises
``SupervisorLost`` once that parent is gone; the loop's exit paths then close the run as for any
other error.
"""

import os


class SupervisorLost(RuntimeError):
    """The ``torchrun`` agent that started this worker has died."""


def under_torchrun() -> bool:
    """Whether this process is a worker started by ``torchrun`` (its agent sets the run id)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class Supervision:
    """Watches this worker's parent, when it is a ``torchrun`` agent (else checks nothing).

    Args:
        watch: whether to watch at all; default: ``under_torchrun()``.
    """

    def __init__(self, *, watch: bool | None = None):
        watch = under_torchrun() if watch is None else watch
        self.parent = os.getppid() if watch else None

    def check(self, step: int) -> None:
        """Raises ``SupervisorLost`` naming the agent's pid and the 0-based ``step``."""
        if self.parent is not None and os.getppid() != self.parent:
            raise SupervisorLost(
                f"the torchrun agent (pid {self.parent}) that started this worker is gone; the "
                f"worker stops at step {step} instead of training on unsupervised"
            )
