"""docs/cli.md and the inspect/flush commands docs/operator.md shows: every
`marucache` command there parses with the real CLI, and every flag of the
page's table is one the command takes, with the default the page gives."""

from __future__ import annotations

import argparse
import pathlib
import re
import shlex

import pytest

from maru_core.index import flush_cli, inspect_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARSERS = {"inspect": inspect_cli, "flush": flush_cli}


def parser_of(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"marucache {command}", exit_on_error=False)
    PARSERS[command].add_arguments(parser)
    return parser


def documented_commands() -> list[list[str]]:
    found = []
    for page in ("cli.md", "operator.md"):
        for block in re.findall(r"```sh\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S):
            for line in block.splitlines():
                if re.search(r"\bmarucache (inspect|flush)\b", line):
                    words = shlex.split(line)
                    found.append(words[words.index("marucache") + 1 :])
    return found


def test_every_documented_command_parses():
    commands = documented_commands()
    assert {c[0] for c in commands} == {"inspect", "flush"} and len(commands) >= 4
    for command, *args in commands:
        parsed = parser_of(command).parse_args(args)
        assert parsed.index.startswith(("tcp://", "unix://")) and parsed.token_file == "/var/run/maru-token/token"


@pytest.mark.parametrize("row", re.findall(r"^\| `(--[a-z-]+)[^`]*` \| (both|inspect|flush) \| (.*) \|$",
                                           (ROOT / "docs" / "cli.md").read_text(), re.M))
def test_every_flag_of_the_table_is_taken_with_its_default(row):
    flag, commands, meaning = row
    for command in PARSERS if commands == "both" else [commands]:
        actions = {option: action for action in parser_of(command)._actions for option in action.option_strings}
        assert flag in actions, f"marucache {command} has no {flag}"
        default = re.search(r"\(default (\d+)\)", meaning)
        if default:
            assert actions[flag].default == int(default.group(1))
