"""``node-agent capture OUT.yaml``: this node as a scenario that replays as this node
(docs/capture.md). With ``--simulate SCENARIO`` the simulated node is captured instead, through
the same recorder (its NVML answered by the stand-in's rules in Python); with
``--from-readings DIR`` nvidia-ml-py readings saved on another host are converted, with
``--from-nvidia-smi FILE`` what ``nvidia-smi -q`` (or ``-q -x``) printed there."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from node_agent.commands.reporting import EXIT_OK, UsageError
from node_agent.config import load_config
from node_agent.environment import kernel_log_path, load_data
from node_agent.sim.capture import (
    KERNEL_LOG_RECORDS,
    CaptureError,
    capture_node,
    dump,
    write_capture,
)


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="record this node (NVML call by call, the PCI bus, the "
        "kernel log) as a scenario that replays as this node",
    )
    common(p)
    p.add_argument("out", metavar="OUT.yaml", help="scenario file to write (replaced whole)")
    p.add_argument("--sku", metavar="NAME", help="SKU file to name when none matches the GPUs")
    p.add_argument(
        "--kernel-log-records",
        type=int,
        default=KERNEL_LOG_RECORDS,
        metavar="N",
        help=f"kernel-log records to keep, the newest (default {KERNEL_LOG_RECORDS})",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--from-readings",
        metavar="DIR",
        help="convert nvidia-ml-py readings (nvml-readings.json, "
        "kernel-log-boot.txt, PROVENANCE.md) instead of reading this node",
    )
    source.add_argument(
        "--from-nvidia-smi",
        metavar="FILE",
        help="convert what `nvidia-smi -q` or `nvidia-smi -q -x` printed (a bug report's "
        "attachment) instead of reading this node; what it does not print (the kernel log, "
        "the PCI bus, NVLink per link) is said in the file, not invented",
    )


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    _grader, skus = load_data(config)
    out = Path(args.out)
    if args.kernel_log_records < 0:
        raise UsageError("--kernel-log-records: expected 0 or more")
    argv = [
        "capture",
        args.out,
        *(["--sku", args.sku] if args.sku else []),
        *(["--simulate", args.simulate] if args.simulate else []),
        *(
            [f"--kernel-log-records={args.kernel_log_records}"]
            if args.kernel_log_records != KERNEL_LOG_RECORDS
            else []
        ),
    ]
    try:
        if args.from_readings:
            from node_agent.sim.capture_import import convert

            command = f"node-agent capture --from-readings {args.from_readings} {args.out}"
            text = convert(Path(args.from_readings), skus, command)
        elif args.from_nvidia_smi:
            from node_agent.sim import nvidia_smi

            command = f"node-agent capture --from-nvidia-smi {args.from_nvidia_smi} {args.out}"
            text = nvidia_smi.convert(Path(args.from_nvidia_smi), skus, command, sku=args.sku)
        elif args.simulate:
            text = _capture_simulated(args, skus, argv)
        else:
            scenario, header = capture_node(
                skus,
                argv,
                sku=args.sku,
                call_timeout_s=config.nvml.call_timeout_s,
                kernel_log_records=args.kernel_log_records,
                kernel_log_file=kernel_log_path(config),
            )
            text = dump(scenario, header)
    except CaptureError as err:
        raise UsageError(str(err)) from err
    write_capture(out, text)
    print(
        f"node-agent: captured into {out}; replay with: node-agent check --simulate {out}",
        file=sys.stderr,
    )
    return EXIT_OK


def _capture_simulated(args: argparse.Namespace, skus: dict[str, Any], argv: list[str]) -> str:
    """A simulated node captured through the same recorder: its NVML as the stand-in would
    answer it (StateNvml over the rendered state), its simulated PCI bus and kernel log."""
    from node_agent.gpu.replay import StateNvml
    from node_agent.sim.node import open_gpus
    from node_agent.sim.nvml_state import render
    from node_agent.sim.scenario import load_scenario
    from node_agent.sim.tools import simulated_pci, write_pci_sysfs

    scenario = load_scenario(args.simulate, skus)
    sku = skus[scenario.sku]
    lib = StateNvml(render(scenario, sku).splitlines())
    backend = open_gpus(scenario, sku)
    try:
        log = list(backend.kernel_log_lines())
    finally:
        backend.close()
    with tempfile.TemporaryDirectory(prefix="node-agent-capture-") as tmp:
        tree = write_pci_sysfs(simulated_pci(scenario, sku), Path(tmp) / "devices")
        kmsg = Path(tmp) / "kmsg"  # a missing kmsg: the log comes from the scenario below
        captured, header = capture_node(
            skus,
            argv,
            sku=args.sku or scenario.sku,
            kernel_log_records=args.kernel_log_records,
            pci_root=tree,
            kmsg_path=str(kmsg),
            nvml_lib=lib,
        )
    captured["hostname"] = scenario.hostname
    captured["kernel_log"] = log[-args.kernel_log_records :] if args.kernel_log_records else []
    captured["capture"]["kind"] = "captured-simulated"
    captured["capture"]["simulated_from"] = scenario.source
    captured["capture"]["kernel_log"] = {
        "source": "the scenario's simulated kernel log",
        "records": len(captured["kernel_log"]),
    }
    captured["capture"]["pci"] = {"source": "the scenario's simulated PCI bus"}
    return dump(captured, [f"{header[0]} (simulated node: {scenario.source})", *header[1:]])
