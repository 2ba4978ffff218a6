"""The ``node-agent`` command line builds one command's parser and imports one command's module:
what a process that runs ``check`` parses and runs must be what the whole parser offers."""

from __future__ import annotations

import argparse

import pytest

from node_agent.commands.main import build_parser, command


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


WHOLE = _subcommands(build_parser())


def test_every_command_of_the_whole_parser_has_a_function_that_runs_it():
    assert len(WHOLE) >= 15
    for name in WHOLE:
        assert callable(command(name)), name


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_commands_own_parser_takes_the_same_options_as_the_whole_one(name):
    own = _subcommands(build_parser(only=name))
    assert name in own
    assert own[name].format_help() == WHOLE[name].format_help()


def test_an_unknown_command_gets_the_whole_parser_whose_error_lists_every_command(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser(only="chek").parse_args(["chek"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'chek'" in err
    for name in ("check", "accept", "daemon", "stop-check", "optout"):
        assert f"'{name}'" in err


@pytest.mark.parametrize(
    "words", [["check", "--bogus"], ["check", "--simulate"], ["act", "drain\x1b[2J"], ["chek"]]
)
def test_a_usage_error_is_one_line_on_stderr_with_what_was_typed_escaped(capsys, words):
    with pytest.raises(SystemExit) as stop:
        build_parser(only=words[0]).parse_args(words)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("--help`)\n"), err
    assert "\x1b" not in err
