"""Check ``cloud_maintenance``: host maintenance the node's cloud has announced.

The cloud often knows before the node does: a host maintenance or a retirement is announced
minutes to days ahead through the instance metadata service (:mod:`node_agent.host.cloud_metadata`
reads GCP, AWS IMDSv2 and Azure Scheduled Events on the link-local address, or an operator's
command for any other cloud). One result, ``maintenance_event`` (``node``):

* ``pass`` — nothing announced;
* ``warn`` — an event announced further ahead than the lead time (``lead_time_s`` of
  ``graders/cloud.yaml``, its one home: 30 min shipped): its kind and start time, so
  the operator sees it coming (graded WARN: never a drain); or Azure events announced while
  this VM's own name cannot be read, so none can be told to be this VM's (never a drain, never
  acknowledged: the events and the lookup's error in the detail);
* ``fail`` — an event inside the lead time, begun, or announced with no start
  time (GCP's ``maintenance-event`` is set about 60 min ahead for GPU VMs): graded ERROR with
  ``remedy: planned`` (graders/rules.yaml), which drains the node with no restart and no
  replacement; the result carries the event (``Result.planned``) for the drain reason, and the
  node resumes when a re-test after the event's end passes (docs/cloud.md);
* ``skip`` — not a cloud instance (DMI), a stand-in node, or no metadata service answered within
  ``timeout_s``;
* ``error`` — the service answered something other than its documented API (never a pass).

Params (:class:`Params`, validated): ``provider`` (``auto``: from DMI; ``gcp``, ``aws``,
``azure``, ``command``, ``none``), ``timeout_s`` (2), ``command`` (argv
of a program printing ``{"events": [...]}``, for ``provider: command``), ``wait_s`` (GCP only:
``wait_for_change`` for up to this long, for a daemon suite that watches; 0: a plain read),
``acknowledge`` (Azure only: acknowledge the event once the agent drained the node, so the
platform starts it at once), ``dmi_root`` and ``metadata_url`` (for tests only: a tree of their
own, and a metadata stand-in on a loopback address; the link-local address otherwise). A
suite that still carries ``lead_time_s`` is refused when it loads, naming graders/cloud.yaml.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from node_agent import atomic_file
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import load_topic, refuse_thresholds
from node_agent.host import cloud_metadata as cm
from node_agent.model import PlannedEvent, Result, Status

#: the topic file of the lead time (checking/thresholds.py): how long before an announced event
#: the node is drained, with its source
TOPIC = "cloud"
CLOUD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"lead_time_s": {"type": "number", "minimum": 0}},
}
#: one request to the link-local service: it answers in milliseconds on a cloud instance
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    provider: str = "auto"
    timeout_s: float = TIMEOUT_S
    command: tuple[str, ...] = ()
    wait_s: float = 0.0
    acknowledge: bool = False
    dmi_root: str = "/"
    metadata_url: str = cm.LINK_LOCAL

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected (for the lead time: its home)."""
        refuse_thresholds("cloud_maintenance", raw, ("lead_time_s",), f"graders/{TOPIC}.yaml")
        r = Reader("cloud_maintenance", raw, cls)
        provider = r.choice("provider", ("auto", "none", *cm.PROVIDERS))
        command = r.strings("command")
        if provider == "command" and not command:
            r.fail("command", list(command), "an argv: provider command needs command")
        url = r.string("metadata_url")
        _check_url(url, "params of cloud_maintenance")
        return cls(
            provider=provider,
            timeout_s=r.positive("timeout_s"),
            command=command,
            wait_s=r.number("wait_s", at_least=0),
            acknowledge=r.flag("acknowledge"),
            dmi_root=r.string("dmi_root"),
            metadata_url=url,
        )


def _check_url(url: Any, where: str) -> None:
    """The link-local address, or (tests) http on a loopback address; nothing else."""
    parts = urlsplit(url) if isinstance(url, str) else None
    try:
        address = ipaddress.ip_address(parts.hostname or "") if parts else None
    except ValueError:
        address = None
    if (
        parts is None
        or parts.scheme != "http"
        or address is None
        or not (address.is_loopback or str(address) == "169.254.169.254")
    ):
        raise ValueError(
            f"{where}: metadata_url {url!r}: the metadata service is reached on "
            f"{cm.LINK_LOCAL} only (a loopback http URL is for tests)"
        )


def run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    provider, why = _provider(ctx, params)
    if provider is None:
        return [ctx.skip(why, metric="maintenance_event")]
    timeout = max(0.2, min(params.timeout_s, ctx.timeout_s * 0.4))
    try:
        events, notes = _read(ctx, params, provider, timeout)
    except cm.MetadataUnreachable as err:
        return [
            ctx.skip(f"{provider}: {err}; no maintenance can be read", "node", "maintenance_event")
        ]
    except cm.AzureEventsUnattributed as err:
        return [unattributed(ctx, provider, err)]
    except cm.MetadataMalformed as err:
        return [
            ctx.result(
                "node",
                "maintenance_event",
                Status.ERROR,
                f"{provider} metadata service: {err}; announced maintenance cannot be read",
                provider=provider,
            )
        ]
    return [judge(ctx, params, provider, events, notes)]


def _provider(ctx: CheckContext, params: Params) -> tuple[str | None, str]:
    if params.provider == "none":
        return None, "provider none in the suite: no cloud metadata is read"
    if params.provider != "auto":
        return params.provider, ""
    if ctx.ports.host_tree is not None or ctx.ports.host_unrecorded is not None:
        if params.dmi_root == "/":
            return None, "stand-in node: no cloud metadata service is modelled"
    found, dmi = cm.detect_provider(Path(params.dmi_root))
    if found is None:
        shown = ", ".join(f"{k}={v!r}" for k, v in dmi.items() if v) or "unreadable"
        return None, (
            f"not a GCP, AWS or Azure instance by its DMI strings ({shown}); for another "
            "cloud set provider: command with a command printing its events"
        )
    return found, ""


def _read(
    ctx: CheckContext, params: Params, provider: str, timeout: float
) -> tuple[list[cm.Event], dict[str, Any]]:
    if provider == "command":
        return cm.read_command(params.command, timeout_s=max(timeout, ctx.timeout_s * 0.5)), {}
    http = cm.Http(params.metadata_url, timeout)
    if provider == "aws":
        return cm.read_aws(http), {}
    if provider == "azure":
        events, vm = cm.read_azure(http)
        return events, {"vm_name": vm}
    etag_file = ctx.state_dir / "cloud_maintenance.etag" if ctx.state_dir else None
    etag = None
    if params.wait_s > 0 and etag_file is not None:
        try:
            etag = etag_file.read_text().strip() or None
        except OSError:
            etag = None
    wait = min(params.wait_s, max(0.0, ctx.timeout_s * 0.5))
    events, new_etag = cm.read_gcp(http, wait_s=wait, etag=etag)
    if params.wait_s > 0 and etag_file is not None and new_etag:
        try:
            atomic_file.write_text(etag_file, new_etag)
        except OSError:
            pass  # the next wait starts without it: it returns at once, nothing is lost
    return events, {}


def unattributed(ctx: CheckContext, provider: str, err: cm.AzureEventsUnattributed) -> Result:
    """WARN: events that may be another VM's are shown, never drained for nor acknowledged."""
    return ctx.result(
        "node",
        "maintenance_event",
        Status.WARN,
        f"{provider}: {err}; not drained and not acknowledged, since they may be another VM's: "
        "check that this VM's instance metadata (compute/name) answers",
        value=None,
        unit="s",
        provider=provider,
        events=[{**event.to_dict(), "resources": names} for event, names in err.events],
        vm_name=None,
        vm_name_error=err.name_error,
    )


def judge(
    ctx: CheckContext,
    params: Params,
    provider: str,
    events: list[cm.Event],
    notes: dict[str, Any],
) -> Result:
    """The one result for the events read: pass, warn (ahead), or fail (inside the lead time)."""
    now = ctx.ports.clock()
    lead_time_s = float(
        load_topic(ctx.config, TOPIC, CLOUD_SCHEMA, "cloud grading file")["lead_time_s"]
    )
    current = [e for e in events if e.ends_at is None or e.ends_at > now]
    evidence = {
        "provider": provider,
        "events": [e.to_dict() for e in events],
        "lead_time_s": lead_time_s,
        **notes,
    }
    if not current:
        past = f" ({len(events)} already over)" if events else ""
        return ctx.result(
            "node",
            "maintenance_event",
            Status.PASS,
            f"{provider}: no maintenance announced{past}",
            value=None,
            unit="s",
            **evidence,
        )
    event = min(current, key=lambda e: e.starts_at if e.starts_at is not None else float("-inf"))
    lead = None if event.starts_at is None else max(0.0, event.starts_at - now)
    planned = PlannedEvent(
        provider=provider,
        kind=event.kind,
        event_id=event.event_id,
        starts_at=cm.iso(event.starts_at),
        ends_at=cm.iso(event.ends_at),
        acknowledge=params.acknowledge and provider == "azure" and event.event_id is not None,
    )
    ends = f", until {planned.ends_at}" if planned.ends_at else ""
    more = f" (and {len(current) - 1} more)" if len(current) > 1 else ""
    if lead is None or lead <= lead_time_s:
        when = (
            f"starting at {planned.starts_at}, in {lead / 60:.0f} min"
            if lead is not None and lead > 0
            else "now (begun, or announced with no start time)"
        )
        status, detail = (
            Status.FAIL,
            (
                f"{provider} maintenance {event.kind} {when}{ends}{more}: inside the "
                f"{lead_time_s / 60:g} min lead time; drain the node (no restart, no "
                "replacement) and resume it after the event"
            ),
        )
    else:
        status, detail = (
            Status.WARN,
            (
                f"{provider} maintenance {event.kind} announced, starting at {planned.starts_at} "
                f"(in {lead / 3600:.1f} h){ends}{more}; drained {lead_time_s / 60:g} min ahead"
            ),
        )
    result = ctx.result(
        "node",
        "maintenance_event",
        status,
        detail,
        value=round(lead, 1) if lead is not None else 0.0,
        unit="s",
        **evidence,
    )
    result.planned = planned
    return result
