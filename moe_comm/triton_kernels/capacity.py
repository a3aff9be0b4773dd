"""A count that lives on the device, checked against a bound the caller chose, with nothing read on the
host: ``check_capacity_kernel`` records CapacityError in the group's error word when count > bound (the
host raises it at the next check, as for every device-found data error).

Used where an op's output size is the caller's choice and the count is known only on the device:
DeepEP's fixed-size normal-mode receive (``num_worst_tokens``, ``moe_comm.compat.deep_ep``), whose rows
past the bound are dropped.
"""

import triton
import triton.language as tl

from .sync import ERR_CAPACITY, record_error


@triton.jit
def check_capacity_kernel(
    count_ptr,        # int64 [1]: the count (on the device)
    grp,              # group state (moe_comm/protocol.py): where the error is recorded
    rank, bound,      # this rank; the largest count that fits
    OP: tl.constexpr,
):
    n = tl.load(count_ptr)
    if n > bound:   # one program, scalar values: uniform
        record_error(grp, ERR_CAPACITY, OP, rank, rank, n, bound)
