"""Drop-in APIs of other libraries, backed by moe-comm's ops.

- ``moe_comm.compat.deep_ep``: DeepEP's low-latency ``Buffer`` (``low_latency_dispatch`` /
  ``low_latency_combine``), so that code written for DeepEP runs by changing one import.

Submodules are imported on demand: importing this package loads nothing else.
"""
