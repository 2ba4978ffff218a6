"""What the node's cloud announces: host maintenance from the instance metadata service.

One reader per provider, each the provider's documented API on the link-local address
(:data:`LINK_LOCAL`, 169.254.169.254: reachable only from the instance itself):

* **gcp** — ``computeMetadata/v1/instance/maintenance-event`` (``NONE``,
  ``MIGRATE_ON_HOST_MAINTENANCE``, ``TERMINATE_ON_HOST_MAINTENANCE``; with ``wait_for_change``
  and ``last_etag`` a request returns when the value changes) and
  ``computeMetadata/v1/instance/upcoming-maintenance`` (JSON: ``type``, ``maintenance_status``
  ``PENDING``/``ONGOING``, ``window_start_time``, ``window_end_time``, RFC 3339; 404 when none),
  both with the header ``Metadata-Flavor: Google``.
* **aws** — IMDSv2: ``PUT latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``,
  then ``GET latest/meta-data/events/maintenance/scheduled`` with ``X-aws-ec2-metadata-token``
  (a JSON list: ``Code`` ``system-reboot``/``instance-retirement``/..., ``EventId``,
  ``NotBefore``/``NotAfter`` as ``21 Jan 2019 09:00:43 GMT``, ``State`` ``active``/
  ``completed``/``canceled``; a completed event's ``Description`` starts ``[Completed]``).
* **azure** — Scheduled Events, ``GET metadata/scheduledevents?api-version=2020-07-01`` with
  ``Metadata: true`` (``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType",
  "Resources", "EventStatus" Scheduled/Started, "NotBefore" RFC 1123 or "", "DurationInSeconds"}]}``);
  every event names the VMs it affects (``Resources``), read against this VM's name
  (``metadata/instance/compute/name``): when that name cannot be read no event can be told to
  be this VM's or another's (:class:`AzureEventsUnattributed`, never a drain). :func:`acknowledge`
  POSTs ``{"StartRequests": [{"EventId": ...}]}`` to the same path: the platform may then start
  the event at once.
* **command** — any other provider (OCI has no maintenance API in its metadata service): a
  program the operator names prints ``{"events": [{"kind", "id", "starts_at", "ends_at"}]}``.

The cloud is detected from the DMI strings the firmware gives the instance
(:func:`detect_provider`, under a ``root`` a test points at a tree of its own). Requests never
go through a proxy (``trust_env`` off: a proxy cannot reach the instance's own link-local
service) and have a short timeout: no answer is :class:`MetadataUnreachable` (the node has no
metadata service, a skip), an answer that is not the documented one is
:class:`MetadataMalformed` (an error, never a pass).
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc

#: the metadata services' link-local address, the same on GCP, AWS and Azure
LINK_LOCAL = "http://169.254.169.254"
PROVIDERS = ("gcp", "aws", "azure", "command")
#: Azure's documented chassis asset tag of its VMs (Azure docs, "Detect if a VM runs in Azure")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
AZURE_API_VERSION = "2020-07-01"
AWS_TOKEN_TTL_S = 60  # the token is used at once; IMDSv2 accepts 1 to 21600
#: an answer larger than this is not the documented one (a few hundred bytes per event)
MAX_ANSWER_BYTES = 256 * 1024
#: what an event's kind or id may hold: the providers' own words, never a reason's metacharacters
_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class MetadataUnreachable(Exception):
    """No metadata service answered (not a cloud instance, blocked, or no answer in time)."""


class MetadataMalformed(Exception):
    """The service answered something other than its documented API."""


class AzureEventsUnattributed(Exception):
    """Azure announced events, each naming the VMs it affects, and this VM's own name could not
    be read: none of them can be told to be this VM's or another VM's of the availability set,
    so none may drain the node or be acknowledged. Carries each event with the names it lists
    (``events``) and why the name could not be read (``name_error``)."""

    def __init__(self, name_error: str, events: list[tuple[Event, list[str]]]) -> None:
        seen = "; ".join(
            f"{event.kind} {event.event_id} for {', '.join(map(repr, names))}"
            for event, names in events
        )
        super().__init__(
            f"{len(events)} scheduled event(s) ({seen[:400]}) cannot be told to be this VM's: "
            f"its name could not be read ({name_error})"
        )
        self.name_error = name_error
        self.events = events


@dataclass(frozen=True)
class Event:
    """One announced maintenance: times are epoch seconds (None: not given, or already begun)."""

    provider: str
    kind: str
    event_id: str | None = None
    starts_at: float | None = None
    ends_at: float | None = None
    status: str = ""
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "kind": self.kind,
            "event_id": self.event_id,
            "starts_at": iso(self.starts_at),
            "ends_at": iso(self.ends_at),
            "status": self.status,
            "description": self.description[:300],
        }


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- which cloud ------------------------------------------------------------------------------
def dmi(root: Path = Path("/")) -> dict[str, str]:
    """The DMI strings that name the instance's maker (empty where unreadable)."""
    out = {}
    for name in ("sys_vendor", "product_name", "bios_vendor", "chassis_asset_tag"):
        try:
            out[name] = (root / "sys/class/dmi/id" / name).read_text(errors="replace").strip()
        except OSError:
            out[name] = ""
    return out


def detect_provider(root: Path = Path("/")) -> tuple[str | None, dict[str, str]]:
    """(``gcp``/``aws``/``azure`` or None, the DMI strings read) from ``root``'s sysfs.

    GCP: ``sys_vendor`` Google or ``product_name`` Google Compute Engine; AWS: ``sys_vendor``
    or ``bios_vendor`` Amazon EC2 (Nitro instances); Azure: ``sys_vendor`` Microsoft
    Corporation with Azure's chassis asset tag (Hyper-V elsewhere has the same vendor)."""
    found = dmi(root)
    if found["sys_vendor"] == "Google" or found["product_name"] == "Google Compute Engine":
        return "gcp", found
    if "Amazon EC2" in (found["sys_vendor"], found["bios_vendor"]):
        return "aws", found
    if (
        found["sys_vendor"] == "Microsoft Corporation"
        and found["chassis_asset_tag"] == AZURE_ASSET_TAG
    ):
        return "azure", found
    return None, found


# -- HTTP -------------------------------------------------------------------------------------
class Http:
    """Bounded requests to one metadata base URL: a short timeout, no proxy, a size cap."""

    def __init__(self, base_url: str, timeout_s: float, session: Any = None) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._requests = requests
        if session is None:
            session = requests.Session()
            session.trust_env = False  # never a proxy: the service is the instance's own
        self.session = session

    def call(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        *,
        params: dict[str, str] | None = None,
        body: bytes | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, str, dict[str, str]]:
        """(status, text, headers); MetadataUnreachable when nothing answers in time."""
        url = f"{self.base_url}/{path}"
        limit = timeout_s or self.timeout_s
        try:
            resp = self.session.request(
                method,
                url,
                headers=headers,
                params=params,
                data=body,
                timeout=(self.timeout_s, limit),
                stream=True,
                allow_redirects=False,
            )
            raw = resp.raw.read(MAX_ANSWER_BYTES + 1, decode_content=True) or b""
            resp.close()
        except self._requests.RequestException as err:
            raise MetadataUnreachable(
                f"no metadata service answered at {self.base_url} within {limit:g} s "
                f"({type(err).__name__})"
            ) from err
        if len(raw) > MAX_ANSWER_BYTES:
            raise MetadataMalformed(
                f"{url} answered more than {MAX_ANSWER_BYTES} bytes; not the documented API"
            )
        return resp.status_code, raw.decode("utf-8", "replace"), dict(resp.headers)


def _json(text: str, url: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise MetadataMalformed(
            f"{url} answered with text that is not JSON: {text[:120]!r}"
        ) from err


def _word(value: Any, what: str, url: str) -> str:
    if not isinstance(value, str) or not _WORD.fullmatch(value):
        raise MetadataMalformed(f"{url}: {what} {value!r:.80} is not a word of the documented API")
    return value


def _epoch_rfc3339(text: str) -> float:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _epoch_aws(text: str) -> float:
    moment = _dt.datetime.strptime(text, "%d %b %Y %H:%M:%S GMT")
    return moment.replace(tzinfo=_dt.timezone.utc).timestamp()


def _epoch_rfc1123(text: str) -> float:
    return email.utils.parsedate_to_datetime(text).timestamp()


#: each provider's time format: its parser and how to name it in an error
RFC3339 = (_epoch_rfc3339, "an RFC 3339 time")
AWS_TIME = (_epoch_aws, "a time like '21 Jan 2019 09:00:43 GMT'")
RFC1123 = (_epoch_rfc1123, "an RFC 1123 time")


def _time(
    value: Any, form: tuple[Callable[[str], float], str], what: str, url: str
) -> float | None:
    """Epoch seconds of a provider's time field; None when absent or empty."""
    if value in (None, ""):
        return None
    parse, name = form
    try:
        return parse(str(value))
    except (TypeError, ValueError) as err:
        raise MetadataMalformed(f"{url}: {what} {value!r:.60} is not {name}") from err


def _http_error(status: int, text: str, url: str) -> MetadataMalformed:
    return MetadataMalformed(f"{url} answered HTTP {status}: {' '.join(text.split())[:200]}")


# -- GCP --------------------------------------------------------------------------------------
GCP_HEADERS = {"Metadata-Flavor": "Google"}
GCP_EVENT = "computeMetadata/v1/instance/maintenance-event"
GCP_UPCOMING = "computeMetadata/v1/instance/upcoming-maintenance"


def read_gcp(http: Http, wait_s: float = 0.0, etag: str | None = None) -> tuple[list[Event], str]:
    """GCP's announced maintenance; returns (events, the maintenance-event's ETag).

    ``wait_s`` > 0: ``wait_for_change`` — the request returns when the value differs from the
    one ``etag`` names, or after ``wait_s`` seconds (the daemon's watch)."""
    params = None
    timeout = None
    if wait_s > 0:
        params = {"wait_for_change": "true", "timeout_sec": str(int(wait_s))}
        if etag:
            params["last_etag"] = etag
        timeout = wait_s + http.timeout_s
    status, text, headers = http.call(
        "GET", GCP_EVENT, GCP_HEADERS, params=params, timeout_s=timeout
    )
    url = f"{http.base_url}/{GCP_EVENT}"
    if status != 200:
        raise _http_error(status, text, url)
    if headers.get("Metadata-Flavor") != "Google":
        raise MetadataMalformed(f"{url} answered without the header Metadata-Flavor: Google")
    value = _word(text.strip(), "maintenance-event", url)
    upcoming = _gcp_upcoming(http)
    events = []
    if value != "NONE":
        events.append(
            Event(
                "gcp",
                value,
                starts_at=upcoming.starts_at if upcoming else None,
                ends_at=upcoming.ends_at if upcoming else None,
                status="announced",
                description="maintenance-event",
            )
        )
    elif upcoming is not None:
        events.append(upcoming)
    return events, headers.get("ETag", "")


def _gcp_upcoming(http: Http) -> Event | None:
    status, text, _ = http.call("GET", GCP_UPCOMING, GCP_HEADERS)
    url = f"{http.base_url}/{GCP_UPCOMING}"
    if status == 404 or (status == 200 and not text.strip()):
        return None  # nothing upcoming (the documented answer)
    if status != 200:
        raise _http_error(status, text, url)
    data = _json(text, url)
    if not isinstance(data, dict):
        raise MetadataMalformed(f"{url}: expected a JSON object, found {type(data).__name__}")
    return Event(
        "gcp",
        _word(data.get("type") or "SCHEDULED", "type", url),
        starts_at=_time(data.get("window_start_time"), RFC3339, "window_start_time", url),
        ends_at=_time(data.get("window_end_time"), RFC3339, "window_end_time", url),
        status=str(data.get("maintenance_status") or ""),
        description="upcoming-maintenance",
    )


# -- AWS --------------------------------------------------------------------------------------
AWS_TOKEN = "latest/api/token"
AWS_EVENTS = "latest/meta-data/events/maintenance/scheduled"
_AWS_DONE = ("completed", "canceled", "cancelled")


def read_aws(http: Http) -> list[Event]:
    """EC2's scheduled events through IMDSv2 (a token first); completed and canceled ones are
    left out."""
    status, token, _ = http.call(
        "PUT", AWS_TOKEN, {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
    )
    if status != 200 or not token.strip():
        raise _http_error(status, token, f"{http.base_url}/{AWS_TOKEN}")
    status, text, _ = http.call("GET", AWS_EVENTS, {"X-aws-ec2-metadata-token": token.strip()})
    url = f"{http.base_url}/{AWS_EVENTS}"
    if status == 404:
        return []  # no scheduled event
    if status != 200:
        raise _http_error(status, text, url)
    data = _json(text, url) if text.strip() else []
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise MetadataMalformed(f"{url}: expected a JSON list of events, found {text[:120]!r}")
    events = []
    for raw in data:
        state = str(raw.get("State") or "").lower()
        description = str(raw.get("Description") or "")
        if state in _AWS_DONE or description.lower().startswith(("[completed]", "[canceled]")):
            continue
        events.append(
            Event(
                "aws",
                _word(raw.get("Code"), "Code", url),
                event_id=_word(raw.get("EventId"), "EventId", url) if raw.get("EventId") else None,
                starts_at=_time(raw.get("NotBefore"), AWS_TIME, "NotBefore", url),
                ends_at=_time(raw.get("NotAfter"), AWS_TIME, "NotAfter", url),
                status=state,
                description=description,
            )
        )
    return events


# -- Azure ------------------------------------------------------------------------------------
AZURE_HEADERS = {"Metadata": "true"}
AZURE_EVENTS = "metadata/scheduledevents"
AZURE_NAME = "metadata/instance/compute/name"


def _azure_vm_name(http: Http) -> tuple[str | None, str]:
    """(this VM's name, "") or (None, why it could not be read)."""
    url = f"{http.base_url}/{AZURE_NAME}"
    try:
        status, text, _ = http.call(
            "GET", AZURE_NAME, AZURE_HEADERS, params={"api-version": "2021-02-01", "format": "text"}
        )
    except (MetadataUnreachable, MetadataMalformed) as err:
        return None, str(err)
    if status != 200:
        return None, str(_http_error(status, text, url))
    if not text.strip():
        return None, f"{url} answered an empty name"
    return text.strip(), ""


def _azure_resources(raw: dict[str, Any], url: str) -> list[str]:
    """The VMs an event affects: Azure lists them in every event (``Resources``)."""
    resources = raw.get("Resources")
    if (
        not isinstance(resources, list)
        or not resources
        or not all(isinstance(name, str) and name for name in resources)
    ):
        raise MetadataMalformed(
            f"{url}: event {raw.get('EventId')!r:.60} has Resources {resources!r:.80}, not the "
            "documented list of the VMs it affects; it cannot be told to be this VM's"
        )
    return resources


def read_azure(http: Http) -> tuple[list[Event], str | None]:
    """Azure's Scheduled Events that name this VM; returns (events, this VM's name, or None
    when no event was announced). AzureEventsUnattributed when events were announced and this
    VM's name cannot be read."""
    status, text, _ = http.call(
        "GET", AZURE_EVENTS, AZURE_HEADERS, params={"api-version": AZURE_API_VERSION}
    )
    url = f"{http.base_url}/{AZURE_EVENTS}"
    if status != 200:
        raise _http_error(status, text, url)
    data = _json(text, url)
    if not isinstance(data, dict) or not isinstance(data.get("Events"), list):
        raise MetadataMalformed(
            f"{url}: expected an object with an Events list, found {text[:120]!r}"
        )
    announced = []
    for raw in data["Events"]:
        if not isinstance(raw, dict):
            raise MetadataMalformed(f"{url}: an event is not an object: {raw!r:.80}")
        announced.append((_azure_event(raw, url), _azure_resources(raw, url)))
    if not announced:
        return [], None
    vm, name_error = _azure_vm_name(http)
    if vm is None:
        raise AzureEventsUnattributed(name_error, announced)
    # an event that does not name this VM is another VM's of the availability set
    return [event for event, resources in announced if vm in resources], vm


def _azure_event(raw: dict[str, Any], url: str) -> Event:
    start = _time(raw.get("NotBefore"), RFC1123, "NotBefore", url)
    duration = raw.get("DurationInSeconds")
    ends = (
        start + duration
        if start is not None and isinstance(duration, int) and duration > 0
        else None
    )
    return Event(
        "azure",
        _word(raw.get("EventType"), "EventType", url),
        event_id=_word(raw.get("EventId"), "EventId", url),
        starts_at=start,
        ends_at=ends,
        status=str(raw.get("EventStatus") or ""),
        description=str(raw.get("Description") or ""),
    )


def acknowledge(event_id: str, base_url: str = LINK_LOCAL, timeout_s: float = 2.0) -> str:
    """Acknowledge an Azure Scheduled Event (``StartRequests``): the platform may start it at
    once. Returns a detail line; raises MetadataUnreachable or MetadataMalformed."""
    http = Http(base_url, timeout_s)
    body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
    status, text, _ = http.call(
        "POST",
        AZURE_EVENTS,
        {**AZURE_HEADERS, "Content-Type": "application/json"},
        params={"api-version": AZURE_API_VERSION},
        body=body,
    )
    if status != 200:
        raise _http_error(status, text, f"{http.base_url}/{AZURE_EVENTS}")
    return f"acknowledged Azure scheduled event {event_id} (StartRequests)"


# -- any other provider: the operator's command --------------------------------------------------
def read_command(
    argv: Sequence[str], timeout_s: float, run: Callable[..., Any] = proc.run
) -> list[Event]:
    """Events a program prints as JSON: ``{"events": [{"kind": "...", "id": "...",
    "starts_at": RFC 3339, "ends_at": RFC 3339}]}`` (OCI and other clouds)."""
    result = run(list(argv), timeout_s=timeout_s)
    what = f"cloud_maintenance command `{' '.join(argv)}`"
    if result.timed_out:
        raise MetadataUnreachable(f"{what} did not finish within {timeout_s:g} s")
    if not result.ok:
        raise MetadataMalformed(f"{what}: {result.describe_failure()}")
    data = _json(result.stdout, what)
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise MetadataMalformed(f'{what} printed no {{"events": [...]}} object')
    events = []
    for raw in data["events"]:
        if not isinstance(raw, dict):
            raise MetadataMalformed(f"{what}: an event is not an object: {raw!r:.80}")
        events.append(
            Event(
                "command",
                _word(raw.get("kind"), "kind", what),
                event_id=_word(raw["id"], "id", what) if raw.get("id") else None,
                starts_at=_time(raw.get("starts_at"), RFC3339, "starts_at", what),
                ends_at=_time(raw.get("ends_at"), RFC3339, "ends_at", what),
                status=str(raw.get("status") or ""),
            )
        )
    return events
