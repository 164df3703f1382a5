"""The I/O stratum of the data plane: the trio adapters that own sockets, deadlines and tasks.

They move bytes between the kernel and the sans-IO modules of `proxycore.protocol`, and decide
nothing of their own: every decision comes back from `proxycore.protocol`.
"""
