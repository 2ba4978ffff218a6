"""The NVML call table (node_agent/gpu/nvml_calls.py) is the one place an NVML call is taught:
a call added to a copy of the table is answered by the Python replay (``StateNvml``) and the C
stand-in ``libnvidia-ml.so.1`` (its getters generated from the copy by scripts/build-nvml-fake),
and recorded by ``node-agent capture``'s recorder, with no code written for it anywhere else.

No GPU can run here: NVML is the stand-ins (the Python replay, and the C library loaded by the
real nvidia-ml-py in a subprocess); the NVML backend, the recorder and the table are the agent's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.gpu import nvml_calls
from node_agent.gpu.base import NoPermission, NotSupported
from node_agent.gpu.nvml import NvmlBackend
from node_agent.gpu.record import record_nvml
from node_agent.gpu.replay import StateNvml, capture_state_lines

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import gen_calls  # noqa: E402  (tests/nvml_fake, not an installed module)
import nvml_fake_harness as harness  # noqa: E402

# A call the agent does not make (nvml.h: nvmlDeviceGetBoardId(nvmlDevice_t, unsigned int *)),
# added by one table entry and nothing else.
THROWAWAY = 'Call("nvmlDeviceGetBoardId", "board_id", (Out("unsigned int", "boardId"),))'
STATE = [
    "nvml-fake-state 1",
    "driver_version 580.65.06",
    "[gpu 0]",
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-00000000-0000-0000-0000-000000000000",
    "pci.bus_id 00000000:18:00.0",
    "board_id 4660",
    "[gpu 1]",
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-00000000-0000-0000-0000-000000000001",
    "pci.bus_id 00000000:2A:00.0",
    "[gpu 2]",
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-00000000-0000-0000-0000-000000000002",
    "pci.bus_id 00000000:3A:00.0",
    "board_id error 4",
]


@pytest.fixture(scope="module")
def table_copy(tmp_path_factory) -> Path:
    """node_agent/gpu/nvml_calls.py, copied, with the throwaway call appended to CALLS."""
    path = tmp_path_factory.mktemp("table") / "nvml_calls_copy.py"
    text = Path(nvml_calls.__file__).read_text()
    path.write_text(f"{text}\n\nCALLS = (*CALLS, {THROWAWAY})\n")
    return path


@pytest.fixture(scope="module")
def calls(table_copy):
    return gen_calls.load_table(table_copy).CALLS


def _board_ids(lib) -> list:
    backend = NvmlBackend(lib)
    backend.init()
    try:
        out = []
        for dev in backend.devices():
            try:
                out.append(backend.call("nvmlDeviceGetBoardId", dev.handle(), gpu=dev.index))
            except (NotSupported, NoPermission) as err:
                out.append(type(err).__name__)
        return out
    finally:
        backend.close()


def test_python_replay_answers_a_call_added_to_the_table(calls):
    assert _board_ids(StateNvml(STATE, calls)) == [4660, "NotSupported", "NoPermission"]
    # the shipped table lacks it: the same state answers "no such function" (an older driver)
    assert _board_ids(StateNvml(STATE)) == ["NotSupported"] * 3
    assert not hasattr(StateNvml(STATE), "nvmlDeviceGetBoardId")


def test_recorder_records_a_call_added_to_the_table_and_its_capture_replays(calls):
    captured = record_nvml(lib=StateNvml(STATE, calls), calls=calls)
    assert [gpu.get("board_id") for gpu in captured["gpus"]] == [
        4660,
        {"error": "Not Supported", "code": 3},
        {"error": "Insufficient Permissions", "code": 4},
    ]
    replayed = StateNvml(capture_state_lines(captured), calls)
    assert _board_ids(replayed) == [4660, "NotSupported", "NoPermission"]


_C_SCRIPT = """
import ctypes, json, sys
import pynvml
sys.path.insert(0, sys.argv[2])
import gen_calls
from node_agent.gpu.record import record_nvml
calls = gen_calls.load_table(sys.argv[1]).CALLS
lib = ctypes.CDLL(sys.argv[3])
pynvml.nvmlInit()
answers = []
for i in range(pynvml.nvmlDeviceGetCount()):
    try:
        answers.append(pynvml.nvmlDeviceGetBoardId(pynvml.nvmlDeviceGetHandleByIndex(i)))
    except pynvml.NVMLError as err:
        answers.append(err.value)
pynvml.nvmlShutdown()
print(json.dumps({
    "answers": answers,
    "exported": [n for c in calls if not c.custom for n in c.names if not hasattr(lib, n)],
    "recorded": [g.get("board_id") for g in record_nvml(calls=calls)["gpus"]],
}))
"""


def _run_c(lib_dir: Path, table: Path, state: Path) -> dict:
    env = harness.agent_env(state=state)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib_dir), env["LD_LIBRARY_PATH"]])
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _C_SCRIPT,
            str(table),
            str(gen_calls.REPO / "tests" / "nvml_fake"),
            str(lib_dir / "libnvidia-ml.so.1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=gen_calls.REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_c_stand_in_generated_from_a_copy_of_the_table_answers_the_added_call(table_copy, tmp_path):
    harness.build()  # the header and the compiler (skips, saying why, where they cannot be had)
    lib_dir = tmp_path / "lib"
    build = subprocess.run(
        [str(harness.BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NVML_FAKE_CALLS": str(table_copy), "NVML_FAKE_OUT": str(lib_dir)},
    )
    assert build.returncode == 0, build.stderr
    assert "nvmlDeviceGetBoardId" in (lib_dir / "nvml_fake_calls.h").read_text()
    state = tmp_path / "state"
    state.write_text("\n".join(STATE) + "\n")

    found = _run_c(lib_dir, table_copy, state)
    assert found["answers"] == [4660, 3, 4]  # the value, NOT_SUPPORTED, NO_PERMISSION
    assert found["exported"] == []  # every name of every table call, the added one included
    assert found["recorded"] == [
        4660,
        {"error": "Not Supported", "code": 3},
        {"error": "Insufficient Permissions", "code": 4},
    ]
    # the library built from the shipped table has no such function (an older driver)
    shipped = _run_c(harness.LIB_DIR, Path(nvml_calls.__file__), state)
    assert shipped["answers"] == [13, 13, 13]  # NVML_ERROR_FUNCTION_NOT_FOUND
    assert shipped["exported"] == []


def test_every_key_a_table_call_records_is_one_the_stand_ins_answer():
    """Each recorded key of each table call, given in a state, is answered as that value by
    the Python replay (the C library runs the same table: the test above)."""
    lines = ["nvml-fake-state 1", "[gpu 0]", "pci.bus_id 00000000:18:00.0", "nvlink.0.state 1"]
    expected = {}
    for call in nvml_calls.CALLS:
        if call.custom or call.system:
            continue
        for values, key in call.keys():
            if values and call.args[0].link and values[0] != 0:
                continue
            number = 1 + len(expected)
            if call.text:
                lines.append(f"{key} text{number}")
                text = f"text{number}"  # a struct's char[] member: the struct's one member
                expected[(call.function, values)] = (text,) if call.struct else text
            elif key != "nvlink.0.state":
                text = " ".join([str(number)] * len(call.outs))
                lines.append(f"{key} {text}")
                want = [1 if o.c_type == "nvmlEnableState_t" else number for o in call.outs]
                expected[(call.function, values)] = want[0] if len(want) == 1 else tuple(want)
    lib = StateNvml(lines)
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    for (function, values), want in expected.items():
        got = getattr(lib, function)(handle, *values)
        got = tuple(vars(got).values()) if hasattr(got, "__dict__") else got
        assert got == want, (function, values)
