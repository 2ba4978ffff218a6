"""Generate the stand-in NVML library's table-driven getters (docs/nvml_fake.md).

Reads a table of NVML calls (``node_agent/gpu/nvml_calls.py``, or the file given) and writes C:
one exported function per name of every call not marked ``custom``, with NVIDIA's signature
(``nvml_fake.c`` includes NVIDIA's ``nvml.h`` first, so a wrong signature is a compile error)
and the table's rules: the arguments pick the key, a missing key is the call's ``missing`` value
or NVML_ERROR_NOT_SUPPORTED, ``error <code>`` answers the code, a number too large for its C type
is NVML_ERROR_UNKNOWN. The hand-written core (``nvml_fake.c``) includes the result.

Use::

    python tests/nvml_fake/gen_calls.py [--table nvml_calls.py] OUT.h

Run by ``scripts/build-nvml-fake``; needs the repository on ``PYTHONPATH`` (the table imports
``node_agent.gpu.base``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TABLE = REPO / "node_agent" / "gpu" / "nvml_calls.py"


def load_table(path: str | Path) -> ModuleType:
    """The table module at ``path`` (a copy with more calls works the same)."""
    name = f"_nvml_calls_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"gen_calls: cannot load the table {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _params(call: Any) -> list[str]:
    params = [] if call.system else ["nvmlDevice_t device"]
    params += [f"{a.c_type} {a.c_name}" for a in call.args]
    if call.struct:
        params.append(f"{call.struct} *out")
    elif call.text:
        params += [f"char *{call.outs[0].c_name}", "unsigned int length"]
    else:
        params += [f"{o.c_type} *{o.c_name}" for o in call.outs]
    return params


def _out(call: Any, index: int) -> str:
    o = call.outs[index]
    return f"out->{o.c_name}" if call.struct else f"*{o.c_name}"


def _assign(call: Any, index: int, value: str) -> str:
    o = call.outs[index]
    if o.c_type == "nvmlEnableState_t":
        value = f"{value} ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED"
    else:
        value = f"({o.c_type}){value}"
    return f"{_out(call, index)} = {value};"


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _arg_checks(call: Any, section: str) -> list[str]:
    lines = []
    for a in call.args:
        limit = "NVML_NVLINK_MAX_LINKS" if a.link else str(len(a.names or ()) or a.count)
        beyond = "NVML_ERROR_INVALID_ARGUMENT" if a.link else f"(nvmlReturn_t){a.beyond}"
        lines += [
            f"    if ((long long){a.c_name} < 0)",
            "        DONE(NVML_ERROR_INVALID_ARGUMENT);",
            f"    if ((unsigned long long){a.c_name} >= {limit})",
            f"        DONE({beyond});",
        ]
        if a.link:
            lines += [
                f"    rc = nvlink_check({section}, (unsigned){a.c_name});",
                "    if (rc != NVML_SUCCESS)",
                "        DONE(rc);",
            ]
    return lines


def _key(call: Any) -> list[str]:
    if not call.args:
        return [f"    const char *key = {_c_string(call.key)};"]
    fmt, values = call.key, []
    for a in call.args:
        named = a.names is not None and not a.link
        fmt = fmt.replace("{" + a.c_name + "}", "%s" if named else "%u")
        values.append(f"names_{a.c_name}[{a.c_name}]" if named else f"(unsigned){a.c_name}")
    return [
        "    char key[FAKE_KEY_MAX];",
        f"    snprintf(key, sizeof key, {_c_string(fmt)}, {', '.join(values)});",
    ]


def _body(call: Any) -> list[str]:
    section = "global" if call.system else "gpu"
    lines = [
        f"    static const char *const names_{a.c_name}[] = {{"
        + ", ".join(_c_string(n) for n in a.names)
        + "};"
        for a in call.args
        if a.names is not None and not a.link
    ]
    lines.append("    SYSTEM_CALL();" if call.system else "    DEVICE_CALL(device);")
    if call.struct or not call.text:
        pointers = ["out"] if call.struct else [o.c_name for o in call.outs]
        lines.append(f"    REQUIRE({' && '.join(pointers)});")
    lines += _arg_checks(call, section)
    lines += _key(call)
    if call.missing is not None:
        lines += [f"    if (!fake_get({section}, key)) {{"]
        lines += [f"        {_assign(call, i, str(call.missing))}" for i in range(len(call.outs))]
        lines += ["        DONE(NVML_SUCCESS);", "    }"]
    if call.text and call.struct:  # a char[] member (nvmlPciInfo_t.busId); the rest zero
        member = _out(call, 0)
        return [
            *lines,
            "    memset(out, 0, sizeof *out);",
            f"    DONE(get_str({section}, key, {member}, sizeof {member}));",
        ]
    if call.text:
        return [*lines, f"    DONE(get_str({section}, key, {call.outs[0].c_name}, length));"]
    n = len(call.outs)
    limits = ", ".join(f"{m}ULL" for m in call.limit())
    lines += [
        f"    static const unsigned long long limits[] = {{{limits}}};",
        f"    unsigned long long v[{n}];",
        f"    rc = get_numbers({section}, key, v, {n}, limits);",
        "    if (rc == NVML_SUCCESS) {",
        *(f"        {_assign(call, i, f'v[{i}]')}" for i in range(n)),
        "    }",
        "    DONE(rc);",
    ]
    return lines


def _error_string(names: dict[int, str]) -> list[str]:
    """nvmlErrorString with the real library's strings (nvidia-smi prints them)."""
    cases = [f"    case {code}: return {_c_string(text)};" for code, text in sorted(names.items())]
    return [
        "",
        "EXPORT const char *nvmlErrorString(nvmlReturn_t result)",
        "{",
        "    switch ((int)result) {",
        '    case 0: return "Success";',
        *cases,
        '    default: return "Unknown Error";',
        "    }",
        "}",
    ]


def generate(table: ModuleType) -> str:
    """The C source of every table-answered call of ``table``, and nvmlErrorString."""
    out = [
        "/* Generated by tests/nvml_fake/gen_calls.py from the NVML call table",
        " * (node_agent/gpu/nvml_calls.py): do not edit; included by nvml_fake.c. */",
        *_error_string(table.ERROR_NAMES),
    ]
    for call in table.CALLS:
        if call.custom:
            continue
        body = _body(call)
        for name in call.names:
            out += ["", f"EXPORT nvmlReturn_t {name}({', '.join(_params(call))})", "{"]
            out += body
            out.append("}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the C file to write")
    parser.add_argument("--table", default=str(DEFAULT_TABLE), help="the NVML call table")
    args = parser.parse_args(argv)
    Path(args.out).write_text(generate(load_table(args.table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
