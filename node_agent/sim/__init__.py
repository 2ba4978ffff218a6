"""Simulated nodes: scenario files and the simulated tools (sysfs trees, tool stand-ins)."""
