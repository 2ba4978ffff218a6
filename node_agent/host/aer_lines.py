"""The PCI core's AER messages in the kernel log, read from the start of the message.

The kernel's PCIe Advanced Error Reporting prints, through ``pci_info``/``pci_err`` on the device
that reports (``<driver> <domain:bus:dev.fn>: ...``; ``drivers/pci/pcie/aer.c`` and ``err.c``,
Linux 4.x to 6.x)::

    pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:00:03.0
    pcieport 0000:80:1b.4: AER: Uncorrectable (Non-Fatal) error message received from 0000:80:1b.4
    pcieport 0000:00:1d.0: AER: Corrected error received: 0000:03:00.0
    nvme 0000:03:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)
    pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, ...
    nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)
    pcieport 0000:00:03.0: AER: device recovery failed
    pcieport 0000:00:03.0: AER: Root Port link has been reset (0)

``received`` lines (the root port's: ``aer_isr_one_error``; 6.x says ``error message received
from``, older ``error received:`` and, before 4.17, ``id=00e8``) name the source; ``PCIe Bus
Error`` lines (``aer_print_error``; ``Corrected``/``Uncorrected`` before 6.10,
``Correctable``/``Uncorrectable`` from it, some kernels put ``AER: `` in front) are one per
device that logged the error, so they are what is counted. ``can't recover`` names a device
whose driver has no AER handler (``report_error_detected``), ``device recovery failed`` the
port whose recovery gave up (``pcie_do_recovery``): the devices below it are off their link
until a reset or reboot.

Only a message that *starts* with ``<driver> <bdf>: `` followed by one of these forms is read;
the framing in front of it (times, hosts, the kmsg header) is the kernel log reader's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from node_agent.gpu.pci import normalise_bus_id

_BDF = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
_DEVICE = re.compile(rf"^(?P<drv>[A-Za-z0-9_.-]{{1,32}}) (?P<bdf>{_BDF}): (?:AER: ?)?(?P<rest>.*)$")
_SEVERITY = (
    r"(?P<sev>Corrected|Correctable|Uncorrected \((?:Non-Fatal|Fatal)\)|"
    r"Uncorrectable \((?:Non-Fatal|Fatal)\))"
)
_BUS_ERROR = re.compile(rf"^PCIe Bus Error: severity={_SEVERITY}(?:, type=(?P<type>[^,]*))?")
_RECEIVED = re.compile(
    rf"^(?P<multi>Multiple )?{_SEVERITY} error (?:message )?received"
    rf"(?::| from)\s*(?:(?P<src>{_BDF})|id=(?P<id>[0-9a-fA-F]{{4}}))?"
)
_CANT_RECOVER = re.compile(r"^can't recover \(no error_detected callback\)")
_RECOVERY_FAILED = re.compile(r"^[Dd]evice recovery failed")
_RECOVERED = re.compile(r"^[Dd]evice recovery successful")
_LINK_RESET = re.compile(r"^(?:Root|Downstream) Port link has been reset")


@dataclass(frozen=True)
class AerLine:
    """One AER message. ``kind``: ``bus_error`` (a device logged an error: ``severity``),
    ``received`` (a port received the message of ``source``), ``cant_recover`` (``bdf``'s
    driver cannot take part in recovery), ``recovery_failed`` (the port ``bdf`` gave up),
    ``recovered``, ``link_reset``. ``severity``: ``corrected``, ``nonfatal``, ``fatal``."""

    kind: str
    driver: str
    bdf: str
    severity: str | None = None
    source: str | None = None
    error_type: str | None = None


def _severity(word: str) -> str:
    if word.startswith("Correct"):
        return "corrected"
    return "fatal" if "(Fatal)" in word else "nonfatal"


def parse_aer_message(message: str) -> AerLine | None:
    """The AER line ``message`` is, or None for any other message (and for one whose device
    prefix is not at its very start).

    >>> parse_aer_message("pcieport 0000:00:03.0: AER: device recovery failed").kind
    'recovery_failed'
    >>> parse_aer_message("python3[7]: pcieport 0000:00:03.0: AER: device recovery failed") is None
    True
    """
    head = _DEVICE.match(message)
    if head is None:
        return None
    rest, driver, bdf = head["rest"], head["drv"], normalise_bus_id(head["bdf"])
    if (m := _BUS_ERROR.match(rest)) is not None:
        return AerLine(
            "bus_error", driver, bdf, _severity(m["sev"]), error_type=(m["type"] or "").strip()
        )
    if (m := _RECEIVED.match(rest)) is not None:
        source = normalise_bus_id(m["src"]) if m["src"] else None
        return AerLine("received", driver, bdf, _severity(m["sev"]), source=source)
    for kind, form in (
        ("cant_recover", _CANT_RECOVER),
        ("recovery_failed", _RECOVERY_FAILED),
        ("recovered", _RECOVERED),
        ("link_reset", _LINK_RESET),
    ):
        if form.match(rest):
            return AerLine(kind, driver, bdf)
    return None


#: words one of which every message read here holds: a cheap test before the framing is parsed
AER_WORDS = ("AER", "PCIe Bus Error")
