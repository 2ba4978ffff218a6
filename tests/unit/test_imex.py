"""The IMEX reader on each documented form of ``nvidia-imex-ctl -N``, and the ``imex`` check.

No IMEX service can run here (it needs NVLink-connected GPUs and their driver), so the check
runs a stand-in ``nvidia-imex-ctl``: a script that prints a saved output form from
tests/data/imex/ (PROVENANCE.md says where each comes from) and exits as the real tool does;
and no GPU is here, so NVML's answers (a GB200 tray on multi-node NVLink, an HGX B200 on its own
NVSwitches) come from the simulated backend. Everything else is the real code: the check, its
typed params, the nodes config it reads, the applicability rule, the subprocess helper and the
shipped grading rules.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent import resources
from node_agent.checking.context import CheckContext
from node_agent.checking.ports import Ports
from node_agent.checks import imex
from node_agent.config import config_from_dict
from node_agent.grading.rules import Grader, load_grader
from node_agent.hardware.sku import load_skus
from node_agent.inventory import Inventory
from node_agent.model import HostInfo, Level, Status
from node_agent.parsers import ParseError
from node_agent.parsers import imex as reader
from node_agent.sim.gpu_model import SimGpuBackend
from node_agent.sim.scenario import Scenario

DATA = Path(__file__).resolve().parents[1] / "data" / "imex"


def sample(name: str) -> str:
    return (DATA / name).read_text()


@functools.cache
def grader() -> Grader:
    return load_grader(resources.shipped_graders_dir())


# -- the reader ----------------------------------------------------------------------------------


def test_text_form_of_an_18_node_domain_reads_every_node_ready_and_up() -> None:
    domain = reader.parse(sample("text_up_18.txt"))
    assert domain.form == "text"
    assert domain.state == "UP"
    assert len(domain.nodes) == 18 and len(domain.ready) == 18
    assert domain.nodes[17].host == "10.20.0.28"
    assert domain.nodes[0].version == "570.172"
    assert domain.connections[17][0] == "CONNECTED"
    assert domain.unconnected() == []
    assert domain.timestamp == "5/4/2026 06:08:10.580"


def test_text_form_marks_the_answering_node_and_reads_unavailable_nodes() -> None:
    domain = reader.parse(sample("text_degraded_marked.txt"))
    assert domain.state == "DEGRADED"
    assert [(n.index, n.state, n.local) for n in domain.nodes] == [
        (0, "READY", False),
        (1, "READY", True),
        (2, "UNAVAILABLE", False),
        (3, "UNAVAILABLE", False),
    ]
    assert domain.nodes[2].version == ""
    assert domain.connections[0][2] == "NEVER_CONNECTED"
    assert domain.connections[3][0] == "INVALID"


def test_json_form_reads_nodes_hosts_names_and_connections() -> None:
    domain = reader.parse(sample("json_up_2.json"))
    assert domain.form == "json"
    assert domain.state == "UP"
    assert [(n.index, n.host, n.hostname, n.state) for n in domain.nodes] == [
        (0, "10.0.0.1", "gpu-node-1", "READY"),
        (1, "10.0.0.2", "gpu-node-2", "READY"),
    ]
    assert domain.connections[0] == {0: "CONNECTED", 1: "CONNECTED"}
    assert all(n.local is None for n in domain.nodes)


def test_json_form_of_a_down_domain_orders_nodes_and_drops_na_hostnames() -> None:
    domain = reader.parse(sample("json_down_2.json"))
    assert domain.state == "DOWN"
    assert [n.index for n in domain.nodes] == [0, 1]
    assert domain.ready == []
    assert domain.nodes[1].hostname == ""  # "N/A"


def test_truncated_text_output_is_refused_naming_the_missing_domain_state() -> None:
    with pytest.raises(ParseError, match="Domain State"):
        reader.parse(sample("text_truncated.txt"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "no 'Node #N"),
        ("error: could not connect", "no 'Node #N"),
        ('{"status": "UP"}', "no 'nodes' object"),
        ('{"nodes": {"0": {"status": "READY"}}}', "no 'status'"),
        ('{"nodes": {"x": {"status": "READY"}}, "status": "UP"}', "not a node number"),
        ('{"nodes": {"0": {"status": "READY"', "truncated or malformed"),
    ],
)
def test_unreadable_output_names_what_was_expected(text: str, expected: str) -> None:
    with pytest.raises(ParseError, match=expected):
        reader.parse(text)


def test_nodes_config_is_one_address_a_line_without_blanks_or_comments() -> None:
    assert reader.parse_nodes_config("# rack 7\n10.0.0.1\n\n 10.0.0.2  # tray 2\n") == [
        "10.0.0.1",
        "10.0.0.2",
    ]


# -- the check through a stand-in nvidia-imex-ctl ------------------------------------------------


def stand_in_tool(tmp_path: Path, output: str, rc: int = 0) -> Path:
    """An ``nvidia-imex-ctl`` that prints ``output`` and exits ``rc``; it records its argv."""
    out = tmp_path / "imex-output"
    out.write_text(output)
    tool = tmp_path / "nvidia-imex-ctl"
    tool.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" > {shlex.quote(str(tmp_path / "argv"))}\n'
        f"cat {shlex.quote(str(out))}\n"
        f"exit {rc}\n"
    )
    tool.chmod(0o755)
    return tool


@functools.cache
def skus() -> dict:
    return load_skus(resources.shipped_graders_dir())


def simulated_gpus(sku: str) -> SimGpuBackend:
    """Four simulated GPUs of ``sku``: NVML's answers decide whether IMEX applies."""
    return SimGpuBackend(Scenario(sku=sku, gpus=4, source="test"), skus()[sku])


@pytest.fixture(autouse=True)
def command_service(tmp_path: Path) -> Iterator[int]:
    """The IMEX daemon's command port, held by the account the tests run as (root in CI) and
    named in the daemon config; the stand-in tool answers in the daemon's place."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (tmp_path / "config.cfg").write_text(f"IMEX_CMD_ENABLED=1\nIMEX_CMD_PORT={port}\n")
        yield port


def make_ctx(tmp_path: Path, sku: str = "gb200-186gb", **params: object) -> CheckContext:
    return CheckContext(
        check="imex",
        gpu=simulated_gpus(sku),
        kernel_log=None,  # type: ignore[arg-type]
        config=config_from_dict({}),
        inventory=Inventory(host=HostInfo(hostname="h", kernel="6.8"), gpus=[], sku=None),
        sku=None,
        expected_gpus=None,
        mode="service",
        params={
            "config": str(tmp_path / "config.cfg"),
            "nodes_config": str(tmp_path / "nodes_config.cfg"),
            "service_units": [str(tmp_path / "nvidia-imex.service")],
            "service_users": [pwd.getpwuid(os.getuid()).pw_name],
            **params,
        },
        timeout_s=10.0,
        ports=Ports(),
    )


def configure(tmp_path: Path, nodes: list[str]) -> None:
    (tmp_path / "nodes_config.cfg").write_text("\n".join(nodes) + "\n")


def by_metric(results: list) -> dict:
    return {r.metric: r for r in results}


def test_every_node_ready_in_an_up_domain_passes(tmp_path: Path) -> None:
    configure(tmp_path, ["10.0.0.1", "10.0.0.2"])
    tool = stand_in_tool(tmp_path, sample("json_up_2.json"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool), local="10.0.0.2"))
    got = by_metric(results)
    assert got["imex_node"].status is Status.PASS
    assert got["imex_node"].evidence["index"] == 1
    assert got["imex_domain"].status is Status.PASS
    assert "2 of 2 configured nodes READY" in got["imex_domain"].detail
    assert grader().grade(results, "service").level is Level.HEALTHY
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["-c", str(tmp_path / "config.cfg"), "-N", "-j"]


def test_a_node_missing_from_the_domain_grades_error_naming_it(tmp_path: Path) -> None:
    configure(tmp_path, ["tray-00", "tray-01", "tray-02", "tray-03"])
    tool = stand_in_tool(tmp_path, sample("text_degraded_marked.txt"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool)))
    got = by_metric(results)
    assert got["imex_node"].status is Status.PASS  # the marked node #1 is READY
    domain = got["imex_domain"]
    assert domain.status is Status.FAIL
    assert "2 of 4 configured nodes READY" in domain.detail
    assert "node #2 tray-02 UNAVAILABLE" in domain.detail
    assert "node #3 tray-03 UNAVAILABLE" in domain.detail
    grade = grader().grade(results, "service")
    assert grade.level is Level.ERROR
    assert any(r.rule == "imex-domain-incomplete" for r in grade.reasons)


def test_this_node_not_ready_grades_error(tmp_path: Path) -> None:
    configure(tmp_path, ["10.0.0.1", "10.0.0.2"])
    tool = stand_in_tool(tmp_path, sample("json_down_2.json"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool), local="10.0.0.1"))
    got = by_metric(results)
    assert got["imex_node"].status is Status.FAIL
    assert "UNAVAILABLE" in got["imex_node"].detail
    assert got["imex_domain"].status is Status.FAIL
    grade = grader().grade(results, "service")
    assert {r.rule for r in grade.reasons} >= {"imex-node-not-ready", "imex-domain-incomplete"}


def test_no_nodes_config_is_a_skip_even_with_the_service_installed(tmp_path: Path) -> None:
    (tmp_path / "nvidia-imex.service").write_text("[Service]\n")
    tool = stand_in_tool(tmp_path, sample("json_down_2.json"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool)))
    assert [r.status for r in results] == [Status.SKIP]
    assert "not configured" in results[0].detail
    assert "service is installed" in results[0].detail
    assert not (tmp_path / "argv").exists()  # the tool was never asked
    assert grader().grade(results, "service").level is Level.HEALTHY


def test_the_daemon_config_names_the_nodes_config(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.cfg"
    elsewhere.write_text("10.0.0.1\n10.0.0.2\n")
    with (tmp_path / "config.cfg").open("a") as config:
        config.write(f"SERVER_PORT=50000\nIMEX_NODE_CONFIG_FILE={elsewhere}\n")
    tool = stand_in_tool(tmp_path, sample("json_up_2.json"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool), local="10.0.0.1"))
    assert by_metric(results)["imex_domain"].status is Status.PASS


def test_the_command_port_nothing_holds_is_never_asked(tmp_path: Path) -> None:
    """Where nothing holds the daemon's command port, whoever binds it next would answer for
    this node: the tool is not run, and the error says what to start."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "config.cfg").write_text(f"IMEX_CMD_ENABLED=1\nIMEX_CMD_PORT={port}\n")
    configure(tmp_path, ["10.0.0.1", "10.0.0.2"])
    tool = stand_in_tool(tmp_path, sample("json_up_2.json"))
    (err,) = imex.run(make_ctx(tmp_path, tool=str(tool), local="10.0.0.2"))
    assert err.status is Status.ERROR and not (tmp_path / "argv").exists()
    assert f"not read: nothing listens on port {port} of this host" in err.detail
    assert "systemctl start nvidia-imex" in err.detail


def test_tool_absent_where_imex_is_configured_is_an_error_naming_the_package(
    tmp_path: Path,
) -> None:
    configure(tmp_path, ["10.0.0.1"])
    results = imex.run(make_ctx(tmp_path, tool=str(tmp_path / "no-such-tool")))
    assert [r.status for r in results] == [Status.ERROR]
    assert "nvidia-imex package" in results[0].detail
    assert grader().grade(results, "delivery").level is Level.ERROR


def test_truncated_output_is_an_error_naming_what_was_expected(tmp_path: Path) -> None:
    configure(tmp_path, ["10.20.0.11"])
    tool = stand_in_tool(tmp_path, sample("text_truncated.txt"))
    results = imex.run(make_ctx(tmp_path, tool=str(tool)))
    assert [r.status for r in results] == [Status.ERROR]
    assert "Domain State" in results[0].detail


def test_tool_failure_is_an_error_with_its_exit_status(tmp_path: Path) -> None:
    configure(tmp_path, ["10.0.0.1"])
    tool = stand_in_tool(tmp_path, "", rc=255)
    results = imex.run(make_ctx(tmp_path, tool=str(tool)))
    assert [r.status for r in results] == [Status.ERROR]
    assert "exited 255" in results[0].detail


def test_a_domain_without_this_host_warns_how_to_name_it(tmp_path: Path) -> None:
    configure(tmp_path, ["10.0.0.1", "10.0.0.2"])
    tool = stand_in_tool(tmp_path, json.dumps(json.loads(sample("json_up_2.json"))))
    results = imex.run(make_ctx(tmp_path, tool=str(tool), local="10.9.9.9"))
    node = by_metric(results)["imex_node"]
    assert node.status is Status.WARN
    assert "local param" in node.detail


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"tool": ""}, "tool '': expected a non-empty string"),
        ({"service_units": "x"}, "service_units"),
        ({"colour": "red"}, "unknown key"),
    ],
)
def test_bad_params_are_refused_naming_the_key(params: dict, expected: str) -> None:
    """Parsed when the suite loads (tests/unit/test_check_params.py: exit 2, nothing run)."""
    with pytest.raises(ValueError, match="params of imex") as err:
        imex.Params.parse(params)
    assert expected in str(err.value)


@pytest.mark.parametrize("sku", ["b200-sxm-180gb", "h100-sxm5-80gb"])
def test_imex_configured_on_a_node_without_multi_node_nvlink_is_a_skip(
    tmp_path: Path, sku: str
) -> None:
    configure(tmp_path, ["10.0.0.1", "10.0.0.2"])
    tool = stand_in_tool(tmp_path, sample("json_down_2.json"))
    results = imex.run(make_ctx(tmp_path, sku=sku, tool=str(tool)))
    assert [r.status for r in results] == [Status.SKIP]
    assert "not on multi-node NVLink" in results[0].detail
    assert not (tmp_path / "argv").exists()
    assert grader().grade(results, "service").level is Level.HEALTHY


def test_an_overlong_host_name_from_a_peer_is_cut() -> None:
    doc = json.loads(sample("json_up_2.json"))
    doc["nodes"]["1"]["hostName"] = "x" * 5000
    domain = reader.parse(json.dumps(doc))
    assert len(domain.nodes[1].hostname) == reader.MAX_NAME
