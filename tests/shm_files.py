"""The /dev/shm files of this test process's own moe-comm sessions (its ``moe_comm.launch`` runs and
shm groups): a leak check must not see another run's files on the same host, which come and go."""

import os

from moe_comm.heap.shm import SHM_DIR, pid_prefix


def own_shm_files() -> list[str]:
    """Names of the shared-memory files of the sessions this process started, sorted."""
    pre = pid_prefix(os.getpid())
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(pre))
