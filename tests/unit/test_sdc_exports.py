"""``node_agent.sdc`` exports the probe API without importing torch: its module
``__getattr__`` loads :mod:`node_agent.sdc.probes` on first use, so the package lists the
probes' names itself. These tests hold that list to the probes module's own ``__all__``."""

from __future__ import annotations

import importlib.util

import pytest

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: node_agent.sdc.probes cannot be imported",
)


@needs_torch
def test_every_name_the_probes_export_is_exported_by_the_package():
    import node_agent.sdc as sdc
    from node_agent.sdc import probes

    missing = sorted(set(probes.__all__) - set(sdc.__all__))
    assert missing == []
    for name in probes.__all__:
        assert getattr(sdc, name) is getattr(probes, name), name


@needs_torch
def test_the_package_names_nothing_the_probes_do_not_export():
    import node_agent.sdc as sdc
    from node_agent.sdc import probes

    lazy = set(sdc._PROBE_NAMES)
    assert lazy - set(probes.__all__) == set()


def test_an_unknown_name_is_an_attribute_error_naming_it():
    import node_agent.sdc as sdc

    with pytest.raises(AttributeError, match="no_such_probe"):
        sdc.no_such_probe  # noqa: B018
