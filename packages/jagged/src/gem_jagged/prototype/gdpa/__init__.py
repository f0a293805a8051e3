"""GDPA's work-list schedule for cross-attention and PMA: not supported API, kept for sweeps.

Production sends cross-attention and PMA to the per-sequence schedule
(``gem_jagged.ops.gdpa.per_sequence_schedule``); ``docs/design/gdpa.md`` explains the choice and
has the numbers. The work-list kernels themselves stay in
``gem_jagged.ops.gdpa.worklist_schedule``, where production uses them for self-attention; this
package holds only the cross/PMA entry points and the options only they read.
"""

from .work_list_cross import (
    WorkListOptions,
    gdpa_backward_work_list,
    gdpa_forward_work_list,
    work_list_options_for,
)

__all__ = [
    "WorkListOptions",
    "gdpa_backward_work_list",
    "gdpa_forward_work_list",
    "work_list_options_for",
]
