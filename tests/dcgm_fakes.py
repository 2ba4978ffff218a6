"""Stand-in DCGM Python bindings (DCGM cannot run without NVIDIA GPUs): the modules
``pydcgm``, ``dcgm_structs``, ``dcgm_agent`` and ``DcgmDiag`` as far as the backend calls them,
recording what it asked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from node_agent.gpu.dcgm import Bindings


class FakeDCGMError(Exception):
    def __init__(self, value):
        super().__init__(f"DCGM error {value}")
        self.value = value


def fake_bindings(
    refuse_hostengine=False,
    refuse_embedded=False,
    diag_response=None,
    health_response=None,
    on_connect=None,
):
    """``health_response`` may be a function of the handle (``"h-<address>"``, ``"h-None"``
    for the embedded engine); ``on_connect(address)`` runs as a host engine is connected to."""
    calls = SimpleNamespace(handles=[], health_set=[], shutdowns=0)

    class Handle:
        def __init__(self, ipAddress=None, opMode=None):  # noqa: N803 - the bindings' names
            if ipAddress and on_connect is not None:
                on_connect(ipAddress)
            if ipAddress and refuse_hostengine:
                raise FakeDCGMError(-2)
            if ipAddress is None and refuse_embedded:
                raise FakeDCGMError(-6)
            self.handle = f"h-{ipAddress}"
            calls.handles.append(ipAddress)

        def Shutdown(self):  # noqa: N802
            calls.shutdowns += 1

    class Diag:
        def __init__(self, gpuIds=None, testNamesStr="", paramsStr="", verbose=True):  # noqa: N803
            calls.diag_args = (gpuIds, testNamesStr)

        def Execute(self, handle):  # noqa: N802
            return diag_response

    agent = SimpleNamespace(
        dcgmHealthSet=lambda h, g, s: calls.health_set.append((h, g, s)),
        dcgmUpdateAllFields=lambda h, wait: None,
        dcgmHealthCheck=lambda h, g: (
            health_response(h) if callable(health_response) else health_response
        ),
    )
    structs = SimpleNamespace(
        DCGMError=FakeDCGMError, DCGM_OPERATION_MODE_AUTO=1, DCGM_GROUP_ALL_GPUS=0x7FFFFFFF
    )
    return Bindings(
        path=Path("/fake/bindings"),
        pydcgm=SimpleNamespace(DcgmHandle=Handle),
        structs=structs,
        agent=agent,
        diag=SimpleNamespace(DcgmDiag=Diag),
    ), calls
