"""The host around the GPUs, read from the kernel's own interfaces: EDAC memory controllers,
installed memory, PCIe AER counters, CPUs, NVMe controllers, and the BMC through ipmitool.

Each reader takes its root (``/sys``, ``/proc``, ``/dev``) or its tool as a parameter, so tests
and the simulator (:mod:`node_agent.sim.host_tools`) hand it a tree of their own; the checks
(``checks/host_memory.py`` ...) grade what the readers return (docs/host_checks.md).
"""
