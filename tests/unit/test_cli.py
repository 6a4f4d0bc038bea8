"""The CLI dispatcher: help, unknown commands, and subcommand routing."""

from __future__ import annotations

import subprocess
import sys

from earl import cli


def test_help_lists_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("train", "stress", "bench", "inspect"):
        assert name in out


def test_unknown_command_is_a_clear_error(capsys):
    assert cli.main(["tran"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'tran'" in err and "train" in err


def test_bench_unknown_name(capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "earl.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "usage: earl" in out
